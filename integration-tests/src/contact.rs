//! Contact sheets: decoded PNGs laid out in a labelled grid.

use anyhow::Context;

/// An RGB image.
#[derive(Clone)]
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

impl Rgb {
    pub fn new(width: usize, height: usize, fill: [u8; 3]) -> Rgb {
        Rgb {
            width,
            height,
            pixels: fill.iter().copied().cycle().take(width * height * 3).collect(),
        }
    }

    /// Decodes an 8-bit RGB or 16-bit grey PNG.
    pub fn decode(png_bytes: &[u8]) -> anyhow::Result<Rgb> {
        let mut decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
        decoder.set_transformations(png::Transformations::STRIP_16 | png::Transformations::EXPAND);
        let mut reader = decoder.read_info()?;
        let mut buf = vec![0; reader.output_buffer_size().context("image too large")?];
        let info = reader.next_frame(&mut buf)?;
        let (w, h) = (info.width as usize, info.height as usize);
        let pixels = match info.color_type {
            png::ColorType::Rgb => buf[..w * h * 3].to_vec(),
            png::ColorType::Grayscale => buf[..w * h].iter().flat_map(|&g| [g, g, g]).collect(),
            other => anyhow::bail!("unexpected colour type {other:?}"),
        };
        Ok(Rgb {
            width: w,
            height: h,
            pixels,
        })
    }

    /// Sets one pixel (nothing outside the image).
    pub fn put(&mut self, x: usize, y: usize, c: [u8; 3]) {
        if x < self.width && y < self.height {
            let i = (y * self.width + x) * 3;
            self.pixels[i..i + 3].copy_from_slice(&c);
        }
    }

    pub fn blit(&mut self, other: &Rgb, x0: usize, y0: usize) {
        for y in 0..other.height {
            for x in 0..other.width {
                let i = (y * other.width + x) * 3;
                self.put(x0 + x, y0 + y, [other.pixels[i], other.pixels[i + 1], other.pixels[i + 2]]);
            }
        }
    }

    /// Draws `text` (digits, `d`, `=`, space) with a 3×5 pixel font scaled by `scale`.
    pub fn label(&mut self, text: &str, x0: usize, y0: usize, scale: usize, color: [u8; 3]) {
        for (i, ch) in text.chars().enumerate() {
            let rows = glyph(ch);
            for (row, bits) in rows.iter().enumerate() {
                for col in 0..3 {
                    if bits & (0b100 >> col) != 0 {
                        for dy in 0..scale {
                            for dx in 0..scale {
                                self.put(x0 + (i * 4 + col) * scale + dx, y0 + row * scale + dy, color);
                            }
                        }
                    }
                }
            }
        }
    }

    pub fn encode(&self) -> anyhow::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width as u32, self.height as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.pixels)?;
        writer.finish()?;
        Ok(out)
    }
}

fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [0b111, 0b101, 0b101, 0b101, 0b111],
        '1' => [0b010, 0b110, 0b010, 0b010, 0b111],
        '2' => [0b111, 0b001, 0b111, 0b100, 0b111],
        '3' => [0b111, 0b001, 0b111, 0b001, 0b111],
        '4' => [0b101, 0b101, 0b111, 0b001, 0b001],
        '5' => [0b111, 0b100, 0b111, 0b001, 0b111],
        '6' => [0b111, 0b100, 0b111, 0b101, 0b111],
        '7' => [0b111, 0b001, 0b010, 0b010, 0b010],
        '8' => [0b111, 0b101, 0b111, 0b101, 0b111],
        '9' => [0b111, 0b101, 0b111, 0b001, 0b111],
        'd' => [0b001, 0b001, 0b111, 0b101, 0b111],
        '=' => [0b000, 0b111, 0b000, 0b111, 0b000],
        _ => [0; 5],
    }
}

/// Lays `images` out in `columns` columns with a label above each.
pub fn sheet(images: &[(String, Rgb)], columns: usize) -> Rgb {
    let (cell_w, cell_h) = images.iter().fold((0, 0), |(w, h), (_, i)| (w.max(i.width), h.max(i.height)));
    let (gap, label_h) = (12, 24);
    let rows = images.len().div_ceil(columns.max(1));
    let mut sheet = Rgb::new(gap + columns * (cell_w + gap), gap + rows * (cell_h + label_h + gap), [24, 24, 28]);
    for (i, (label, image)) in images.iter().enumerate() {
        let (col, row) = (i % columns, i / columns);
        let x = gap + col * (cell_w + gap);
        let y = gap + row * (cell_h + label_h + gap);
        sheet.label(label, x, y + 2, 3, [235, 235, 235]);
        sheet.blit(image, x, y + label_h);
    }
    sheet
}
