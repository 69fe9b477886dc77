//! An init image and a mask read from PNG as diffusers' `VaeImageProcessor` prepares them: the
//! image converted to RGB (as PIL's `convert("RGB")`: alpha dropped, grey repeated) and scaled
//! to [-1, 1] (`x / 255 * 2 - 1`); the mask converted to grey (PIL's `convert("L")` luma),
//! scaled to [0, 1] and binarized at 0.5 (1 = repaint). Both must already be the size asked for:
//! nothing is resized.

use super::request::ImageInput;

/// The most pixels an input image may have (a 4096 × 4096 image), checked from its header
/// before anything is decoded.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// 8-bit RGB pixels of a PNG, row-major, with its size.
struct Rgb8 {
    width: usize,
    height: usize,
    data: Vec<u8>,
}

/// Decodes a PNG (any colour type and depth, at most [`MAX_PIXELS`]) to 8-bit RGB.
fn rgb8(bytes: &[u8]) -> Result<Rgb8, String> {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| format!("not a PNG: {e}"))?;
    let info = reader.info();
    let (width, height) = (info.width as usize, info.height as usize);
    if width as u64 * height as u64 > MAX_PIXELS {
        return Err(format!("{width}x{height} is over the {MAX_PIXELS} pixels an input image may have"));
    }
    let size = reader.output_buffer_size().ok_or("the PNG's size overflows")?;
    let mut buffer = vec![0u8; size];
    let frame = reader.next_frame(&mut buffer).map_err(|e| format!("decoding the PNG: {e}"))?;
    let channels = frame.color_type.samples();
    let data = buffer[..frame.buffer_size()]
        .chunks(channels)
        .flat_map(|p| match channels {
            1 | 2 => [p[0], p[0], p[0]],
            _ => [p[0], p[1], p[2]],
        })
        .collect();
    Ok(Rgb8 { width, height, data })
}

/// Checks an image is `width` × `height`.
fn sized(image: Rgb8, what: &str, width: usize, height: usize) -> Result<Rgb8, String> {
    if (image.width, image.height) != (width, height) {
        return Err(format!(
            "the {what} is {}x{}, the request {width}x{height} (images are not resized)",
            image.width, image.height
        ));
    }
    Ok(image)
}

/// The init image (and mask) of an img2img or inpainting request of `width` × `height`.
pub fn image_input(init: &[u8], mask: Option<&[u8]>, strength: f64, width: usize, height: usize) -> Result<ImageInput, String> {
    let image = sized(rgb8(init).map_err(|e| format!("init image: {e}"))?, "init image", width, height)?;
    let plane = width * height;
    // CHW in [-1, 1], as diffusers normalizes: x / 255 * 2 - 1 in float32.
    let mut chw = vec![0f32; 3 * plane];
    for (p, rgb) in image.data.chunks(3).enumerate() {
        for c in 0..3 {
            chw[c * plane + p] = rgb[c] as f32 / 255.0 * 2.0 - 1.0;
        }
    }
    let mask = match mask {
        None => None,
        Some(bytes) => {
            let m = sized(rgb8(bytes).map_err(|e| format!("mask image: {e}"))?, "mask image", width, height)?;
            Some(
                m.data
                    .chunks(3)
                    .map(|p| {
                        // PIL's L = R·299/1000 + G·587/1000 + B·114/1000, in its fixed point.
                        let luma = (p[0] as u32 * 19595 + p[1] as u32 * 38470 + p[2] as u32 * 7471 + 0x8000) >> 16;
                        if luma as f32 / 255.0 >= 0.5 { 1.0 } else { 0.0 }
                    })
                    .collect(),
            )
        }
    };
    Ok(ImageInput {
        image: chw,
        mask,
        strength,
    })
}
