//! An init image and a mask read from PNG as diffusers' `VaeImageProcessor` prepares them: the
//! image converted to RGB (as PIL's `convert("RGB")`: alpha dropped, grey repeated) and scaled
//! to [-1, 1] (`x / 255 * 2 - 1`); the mask converted to grey (PIL's `convert("L")` luma),
//! scaled to [0, 1] and binarized at 0.5 (1 = repaint). Both must already be the size asked for:
//! nothing is resized.

use super::request::ImageInput;

/// The most pixels an input image may have (a 4096 × 4096 image), checked from its header
/// before anything is decoded.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// Decodes a PNG (any colour type and depth, at most [`MAX_PIXELS`]) of `width` × `height` to
/// 8-bit RGB pixels, row-major; the size is checked from the header, before anything is allocated for pixels.
fn rgb8(bytes: &[u8], what: &str, width: usize, height: usize) -> Result<Vec<u8>, String> {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| format!("not a PNG: {e}"))?;
    let info = reader.info();
    let (w, h) = (info.width as usize, info.height as usize);
    if w as u64 * h as u64 > MAX_PIXELS {
        return Err(format!("{w}x{h} is over the {MAX_PIXELS} pixels an input image may have"));
    }
    if (w, h) != (width, height) {
        return Err(format!(
            "the {what} is {w}x{h}, the request {width}x{height} (images are not resized)"
        ));
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
    Ok(data)
}

/// The init image (and mask) of an img2img or inpainting request of `width` × `height`.
pub fn image_input(init: &[u8], mask: Option<&[u8]>, strength: f64, width: usize, height: usize) -> Result<ImageInput, String> {
    let image = rgb8(init, "init image", width, height).map_err(|e| format!("init image: {e}"))?;
    let plane = width * height;
    // CHW in [-1, 1], as diffusers normalizes: x / 255 * 2 - 1 in float32.
    let mut chw = vec![0f32; 3 * plane];
    for (p, rgb) in image.chunks(3).enumerate() {
        for c in 0..3 {
            chw[c * plane + p] = rgb[c] as f32 / 255.0 * 2.0 - 1.0;
        }
    }
    let mask = match mask {
        None => None,
        Some(bytes) => {
            let m = rgb8(bytes, "mask image", width, height).map_err(|e| format!("mask image: {e}"))?;
            Some(
                m.chunks(3)
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
