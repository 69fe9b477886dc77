//! Input images of img2img and inpainting requests. They come inline, as data URLs in the JSON
//! body (`init_image`, `mask_image`), and never travel in a task record: each is decoded (PNG,
//! JPEG or WebP; the header's size checked before any pixel is decoded, so a decompression bomb
//! costs nothing), checked to be exactly the task's size, converted to 8-bit RGB, stored as a
//! PNG create-only under its SHA-256 in the input store (`SLUICE_INPUT_URL`), and the record
//! carries the key and the hash. Workers read it from their own input store and check the hash.
//!
//! Storing the decoded pixels as PNG, rather than what the client sent, means every worker reads
//! one lossless format and a JPEG is decoded once, here, by one decoder.

use std::io::Cursor;

use base64::Engine;
use image::{ImageDecoder, ImageFormat, ImageReader, Limits};
use object_store::path::Path;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};
use sha2::{Digest, Sha256};
use sluice_schemas::{ImageRef, TaskRecord};

use std::sync::Arc;
use thiserror::Error;

/// The data URLs of a request's `init_image` and `mask_image`, as admission read them.
#[derive(Default)]
pub(crate) struct InlineImages {
    pub init: Option<String>,
    pub mask: Option<String>,
}

/// The default largest input image, decoded from its data URL: 4 MiB.
pub const DEFAULT_MAX_BYTES: usize = 4 << 20;

/// The largest side an input image's header may claim before it is refused unread.
const MAX_SIDE: u32 = 4096;

#[derive(Debug, Error)]
pub enum InputImageError {
    /// The field's image is not one the task can use: a 400 naming the field.
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
    /// The input store failed: the request is refused as unavailable, the client may retry.
    #[error("storing the input image: {0}")]
    Store(#[from] object_store::Error),
}

fn invalid(field: &'static str, message: impl Into<String>) -> InputImageError {
    InputImageError::Invalid {
        field,
        message: message.into(),
    }
}

/// The input store and its bounds.
pub struct InputImages {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    max_bytes: usize,
    /// Images decoded at once: one per core, so a burst of image requests queues here instead
    /// of holding a decoded image per request in memory.
    decodes: tokio::sync::Semaphore,
}

impl InputImages {
    /// Opens the input store at `url` (`s3://bucket/prefix` or `file:///path`); images over
    /// `max_bytes` decoded are refused.
    pub fn open(url: &str, max_bytes: usize) -> Result<InputImages, sluice_service::object_url::ObjectUrlError> {
        let at = sluice_service::object_url::open(url, std::iter::empty::<(String, String)>())?;
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(InputImages {
            store: at.store,
            prefix: at.prefix,
            max_bytes,
            decodes: tokio::sync::Semaphore::new(cores),
        })
    }

    /// The request body a task with both images may need beyond the ordinary limit: two data
    /// URLs of the largest image, base64 and their prefixes.
    pub fn body_allowance(&self) -> usize {
        2 * (self.max_bytes.div_ceil(3) * 4 + 64)
    }

    /// Decodes and checks the data URL of `field` for a task of `width` × `height`, stores it,
    /// and gives its reference.
    pub async fn store(&self, field: &'static str, data_url: String, width: u32, height: u32) -> Result<ImageRef, InputImageError> {
        let max_bytes = self.max_bytes;
        let _decoding = self.decodes.acquire().await.expect("never closed");
        let png = tokio::task::spawn_blocking(move || canonical_png(field, &data_url, width, height, max_bytes))
            .await
            .map_err(|e| invalid(field, format!("decoding failed: {e}")))??;
        let reference = ImageRef::of_sha256(hex(&Sha256::digest(&png)));
        let key = self.prefix.clone().join(reference.key.as_str());
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store.put_opts(&key, PutPayload::from(png), create).await {
            // Content-addressed: an existing object under the key holds these very bytes.
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(reference),
            Err(e) => Err(e.into()),
        }
    }
}

impl InputImages {
    /// Stores the request's inline images and sets the record's references to them.
    pub(crate) async fn attach(&self, record: &mut TaskRecord, images: InlineImages) -> Result<(), InputImageError> {
        let (w, h) = (record.request.width, record.request.height);
        if let Some(url) = images.init {
            record.request.init_image = Some(self.store("init_image", url, w, h).await?);
        }
        if let Some(url) = images.mask {
            record.request.mask_image = Some(self.store("mask_image", url, w, h).await?);
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The image of a data URL as an 8-bit RGB PNG, or why it can't be the task's input.
pub(crate) fn canonical_png(
    field: &'static str,
    data_url: &str,
    width: u32,
    height: u32,
    max_bytes: usize,
) -> Result<Vec<u8>, InputImageError> {
    let (mime, payload) = data_url
        .strip_prefix("data:")
        .and_then(|rest| rest.split_once(";base64,"))
        .ok_or_else(|| invalid(field, "must be a data URL: data:image/png;base64,..."))?;
    let format = match mime {
        "image/png" => ImageFormat::Png,
        "image/jpeg" => ImageFormat::Jpeg,
        "image/webp" => ImageFormat::WebP,
        other => return Err(invalid(field, format!("{other:?} is not image/png, image/jpeg or image/webp"))),
    };
    if payload.len() > max_bytes.div_ceil(3) * 4 + 4 {
        return Err(invalid(field, format!("over the {max_bytes} bytes an input image may have")));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| invalid(field, format!("not base64: {e}")))?;
    if bytes.len() > max_bytes {
        return Err(invalid(
            field,
            format!("{} bytes; an input image may have {max_bytes}", bytes.len()),
        ));
    }
    let mut reader = ImageReader::with_format(Cursor::new(&bytes), format);
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    // The decoded image and one conversion of it, at most.
    limits.max_alloc = Some(2 * 4 * u64::from(width) * u64::from(height) + (1 << 20));
    reader.limits(limits);
    let bad = |e: image::ImageError| invalid(field, format!("not a readable {}: {e}", mime.trim_start_matches("image/")));
    let decoder = reader.into_decoder().map_err(bad)?;
    let (w, h) = decoder.dimensions();
    // This check is what bounds the decoded image: `from_decoder` allocates the header's size
    // without applying `max_alloc` (image 0.25), so it must stay before the decode.
    if (w, h) != (width, height) {
        return Err(invalid(
            field,
            format!("the image is {w}x{h}, the task {width}x{height}: send width and height of the image (images are not resized)"),
        ));
    }
    let rgb = image::DynamicImage::from_decoder(decoder).map_err(bad)?.into_rgb8();
    let mut png = Vec::new();
    rgb.write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
        .map_err(|e| invalid(field, format!("re-encoding as PNG: {e}")))?;
    Ok(png)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_url(format: ImageFormat, mime: &str, w: u32, h: u32) -> String {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, 128]));
        let mut bytes = Vec::new();
        image::DynamicImage::ImageRgb8(img)
            .write_to(&mut Cursor::new(&mut bytes), format)
            .unwrap();
        format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    #[test]
    fn png_and_jpeg_of_the_task_size_become_rgb_pngs() {
        for (format, mime) in [(ImageFormat::Png, "image/png"), (ImageFormat::Jpeg, "image/jpeg")] {
            let png = canonical_png("init_image", &data_url(format, mime, 64, 48), 64, 48, DEFAULT_MAX_BYTES).unwrap();
            let back = image::load_from_memory_with_format(&png, ImageFormat::Png).unwrap();
            assert_eq!((back.width(), back.height()), (64, 48), "{mime}");
            assert_eq!(back.color(), image::ColorType::Rgb8, "{mime}");
        }
        // PNG is lossless: the pixels are the client's.
        let png = canonical_png(
            "init_image",
            &data_url(ImageFormat::Png, "image/png", 64, 48),
            64,
            48,
            DEFAULT_MAX_BYTES,
        )
        .unwrap();
        let back = image::load_from_memory(&png).unwrap().into_rgb8();
        assert_eq!(back.get_pixel(9, 3).0, [63, 15, 128]);
    }

    fn refusal(url: &str, w: u32, h: u32, max: usize) -> String {
        match canonical_png("mask_image", url, w, h, max) {
            Err(InputImageError::Invalid { field, message }) => {
                assert_eq!(field, "mask_image");
                message
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn bad_images_are_refused_naming_why() {
        let png = data_url(ImageFormat::Png, "image/png", 64, 48);
        assert!(refusal(&png, 64, 64, DEFAULT_MAX_BYTES).contains("the image is 64x48, the task 64x64"));
        assert!(refusal("https://example.com/a.png", 64, 64, DEFAULT_MAX_BYTES).contains("data URL"));
        assert!(refusal("data:image/gif;base64,R0lG", 64, 64, DEFAULT_MAX_BYTES).contains("image/gif"));
        assert!(refusal("data:image/png;base64,!!!", 64, 64, DEFAULT_MAX_BYTES).contains("not base64"));
        assert!(refusal("data:image/png;base64,aGVsbG8=", 64, 64, DEFAULT_MAX_BYTES).contains("not a readable png"));
        assert!(refusal(&png, 64, 48, 100).contains("over the 100 bytes"));
        // A JPEG declared as PNG is not read as a JPEG.
        let jpeg_as_png = data_url(ImageFormat::Jpeg, "image/jpeg", 64, 48).replace("image/jpeg", "image/png");
        assert!(refusal(&jpeg_as_png, 64, 48, DEFAULT_MAX_BYTES).contains("not a readable png"));
    }

    #[test]
    fn a_decompression_bomb_is_refused_from_its_header() {
        // An 8192 x 8192 PNG of one colour compresses to ~100 KB; decoded as RGB it would be
        // 200 MB. Its header is refused before any pixel is decoded.
        let mut bytes = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut bytes, 8192, 8192);
            encoder.set_color(png::ColorType::Grayscale);
            encoder.set_depth(png::BitDepth::Eight);
            encoder.set_compression(png::Compression::Fast);
            let mut writer = encoder.write_header().unwrap();
            let mut stream = writer.stream_writer().unwrap();
            let row = vec![0u8; 8192];
            for _ in 0..8192 {
                std::io::Write::write_all(&mut stream, &row).unwrap();
            }
            stream.finish().unwrap();
        }
        assert!(bytes.len() < DEFAULT_MAX_BYTES, "{} bytes", bytes.len());
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes));
        let message = refusal(&url, 512, 512, DEFAULT_MAX_BYTES);
        assert!(message.contains("not a readable png"), "{message}");
    }
}
