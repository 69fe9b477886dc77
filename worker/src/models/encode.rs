//! PNG encoding of rendered images.

use png::{BitDepth, ColorType, Compression, Encoder};

/// An encoded image, ready to store.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    pub bytes: Vec<u8>,
    pub width: u32,
    pub height: u32,
    pub content_type: &'static str,
}

fn encode(width: u32, height: u32, color: ColorType, depth: BitDepth, data: &[u8]) -> Result<Image, String> {
    let mut bytes = Vec::with_capacity(data.len() / 2 + 1024);
    let mut encoder = Encoder::new(&mut bytes, width, height);
    encoder.set_color(color);
    encoder.set_depth(depth);
    // Fast compression: encoding must keep up with inference, and these images are small.
    encoder.set_compression(Compression::Fast);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(data).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(Image {
        bytes,
        width,
        height,
        content_type: "image/png",
    })
}

/// 8-bit RGB, `data` row-major `width * height * 3` bytes.
pub fn png_rgb8(width: u32, height: u32, data: &[u8]) -> Result<Image, String> {
    encode(width, height, ColorType::Rgb, BitDepth::Eight, data)
}

/// 16-bit greyscale, one value per pixel.
pub fn png_grey16(width: u32, height: u32, values: &[u16]) -> Result<Image, String> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_be_bytes()).collect();
    encode(width, height, ColorType::Grayscale, BitDepth::Sixteen, &data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(image: &Image) -> (png::OutputInfo, Vec<u8>) {
        let decoder = png::Decoder::new(std::io::Cursor::new(&image.bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info, buf)
    }

    #[test]
    fn rgb_and_grey16_decode_to_what_was_encoded() {
        let rgb: Vec<u8> = (0..5 * 3 * 3).map(|i| i as u8).collect();
        let (info, data) = decode(&png_rgb8(5, 3, &rgb).unwrap());
        assert_eq!(
            (info.width, info.height, info.color_type, info.bit_depth),
            (5, 3, ColorType::Rgb, BitDepth::Eight)
        );
        assert_eq!(data, rgb);

        let grey: Vec<u16> = vec![0, 1, 65535, 300];
        let (info, data) = decode(&png_grey16(2, 2, &grey).unwrap());
        assert_eq!((info.color_type, info.bit_depth), (ColorType::Grayscale, BitDepth::Sixteen));
        let back: Vec<u16> = data.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect();
        assert_eq!(back, grey);
    }
}
