//! img2img and inpainting inside the denoising loop, as diffusers'
//! `StableDiffusion{,XL}{Img2Img,Inpaint}Pipeline` run them:
//!
//! - the init image (in [-1, 1]) through the VAE encoder: its output is the mean and the
//!   log-variance together; the log-variance is clamped to [-30, 20] and the latents sampled as
//!   `mean + exp(logvar / 2) · draw` with the task's one draw, times the VAE's scaling factor;
//! - the loop starts at the first step run, from the encoded image noised to that step by the
//!   sampler's own `add_noise` (img2img, also at strength 1; inpainting below strength 1), or from
//!   pure noise × the initial σ (inpainting at strength 1);
//! - an inpainting UNet (9 channels) takes `[latents, mask, masked-image latents]`: the mask
//!   nearest-downsampled to the latents, the masked image (`image · (mask < 0.5)`) encoded with the
//!   same draw;
//! - an ordinary UNet inpaints by blending the known region back after every step: the encoded
//!   image noised to the next step (not noised after the last), `(1 - mask) · known + mask · x`.

use crate::engine::{EngineError, OrtBackend, Tensor};
use crate::models::diffusion::schedulers::Schedule;
use crate::models::diffusion::stages::distinct_rows;

/// A call's image conditioning, per image row.
pub(super) struct ImageLatents {
    /// The encoded init image × scaling factor, `per_image` values a row (absent where the
    /// pipeline does not encode it: a 9-channel inpainting run at strength 1).
    encoded: Option<Vec<f32>>,
    /// Inpainting: the mask at the latents' resolution, `h · w` values a row.
    mask: Option<Vec<f32>>,
    /// A 9-channel inpainting UNet's masked-image latents, `per_image` values a row.
    masked: Option<Vec<f32>>,
    /// The first step run; 0 is strength 1.
    begin: usize,
    /// Latent pixels of one image (h · w).
    plane: usize,
}

/// What [`ImageLatents::encode`] reads of a call.
pub(super) struct ImageCall<'a> {
    /// `init_image` [n, 3, H, W] in [-1, 1].
    pub image: &'a Tensor,
    /// `image_noise` [n, c·h·w]: each row's task's VAE draw.
    pub draw: &'a [f32],
    /// `mask` [n, 1, H, W] (inpainting), 1 = repaint.
    pub mask: Option<&'a Tensor>,
    pub begin: usize,
    /// Whether the UNet takes the mask and masked image as channels (9-channel inpainting).
    pub mask_channels: bool,
    pub scaling_factor: f32,
    /// Pixels per latent along each axis.
    pub vae_scale: usize,
}

impl ImageLatents {
    /// Encodes what the call's mode needs on `encoder`.
    pub(super) fn encode(encoder: &mut OrtBackend, call: ImageCall<'_>) -> Result<ImageLatents, EngineError> {
        let image = call.image.floats()?;
        let (n, h, w) = (call.image.shape[0], call.image.shape[2], call.image.shape[3]);
        let mut sample = |pixels: &[f32]| sample_latents(encoder, pixels, [n, 3, h, w], call.draw, call.scaling_factor);
        let inpainting = call.mask.is_some();
        let encoded = match !inpainting || call.begin > 0 || !call.mask_channels {
            true => Some(sample(image)?),
            false => None,
        };
        let (mut mask, mut masked) = (None, None);
        let (lh, lw) = (h / call.vae_scale, w / call.vae_scale);
        if let Some(m) = call.mask {
            let m = m.floats()?;
            // torch's nearest interpolation to (h/8, w/8): the pixel at (8y, 8x).
            let small: Vec<f32> = m
                .chunks(h * w)
                .flat_map(|plane| (0..lh * lw).map(move |p| plane[(p / lw) * call.vae_scale * w + (p % lw) * call.vae_scale]))
                .collect();
            if call.mask_channels {
                let kept: Vec<f32> = image
                    .chunks(3 * h * w)
                    .zip(m.chunks(h * w))
                    .flat_map(|(rgb, plane)| {
                        rgb.chunks(h * w)
                            .flat_map(move |c| c.iter().zip(plane).map(|(x, &k)| if k < 0.5 { *x } else { 0.0 }))
                    })
                    .collect();
                masked = Some(sample(&kept)?);
            }
            mask = Some(small);
        }
        Ok(ImageLatents {
            encoded,
            mask,
            masked,
            begin: call.begin,
            plane: lh * lw,
        })
    }

    /// The loop's starting latents from the standard-normal `start` [n, per_image].
    pub(super) fn initial(&self, schedule: &Schedule, start: &[f32]) -> Result<Vec<f32>, EngineError> {
        match (&self.encoded, &self.mask) {
            (_, Some(_)) if self.begin == 0 => Ok(start.iter().map(|v| v * schedule.init_noise_sigma()).collect()),
            (Some(encoded), _) => schedule.add_noise(self.begin, encoded, start).map_err(run),
            (None, _) => Err(EngineError::Run("an img2img call without its encoded image".into())),
        }
    }

    /// A 9-channel UNet's `sample` for the `active` rows: each row's scaled latents, its mask and
    /// its masked-image latents, along the channels.
    pub(super) fn with_mask_channels(&self, sample: &[f32], active: &[usize], per_image: usize) -> Vec<f32> {
        let (Some(mask), Some(masked)) = (&self.mask, &self.masked) else {
            return sample.to_vec();
        };
        let plane = self.plane;
        let mut out = Vec::with_capacity(active.len() * (2 * per_image + plane));
        for (k, &r) in active.iter().enumerate() {
            out.extend_from_slice(&sample[k * per_image..(k + 1) * per_image]);
            out.extend_from_slice(&mask[r * plane..(r + 1) * plane]);
            out.extend_from_slice(&masked[r * per_image..(r + 1) * per_image]);
        }
        out
    }

    /// After step `i`, an ordinary UNet's inpainting: the known region of each active row set
    /// back to the encoded image, noised to step `i + 1` (clean after the last step) with the
    /// row's initial noise from `start`.
    pub(super) fn blend_known_region(
        &self,
        schedule: &Schedule,
        i: usize,
        latents: &mut [f32],
        active: &[usize],
        start: &[f32],
    ) -> Result<(), EngineError> {
        let (Some(mask), Some(encoded)) = (&self.mask, &self.encoded) else {
            return Ok(());
        };
        let plane = self.plane;
        let per_image = encoded.len() / (mask.len() / plane).max(1);
        let last = i + 1 >= schedule.timesteps().len();
        for &r in active {
            let span = r * per_image..(r + 1) * per_image;
            let known = match last {
                true => encoded[span.clone()].to_vec(),
                false => schedule
                    .add_noise(i + 1, &encoded[span.clone()], &start[span.clone()])
                    .map_err(run)?,
            };
            let m = &mask[r * plane..(r + 1) * plane];
            for (j, (x, k)) in latents[span].iter_mut().zip(known).enumerate() {
                let keep = m[j % plane];
                *x = (1.0 - keep) * k + keep * *x;
            }
        }
        Ok(())
    }
}

/// The VAE encoder's sampled latents of `pixels` [rows, 3, H, W] × `scaling_factor`, each row
/// sampled with its row of `draw`. Rows with the same pixels are encoded once.
fn sample_latents(
    encoder: &mut OrtBackend,
    pixels: &[f32],
    shape: [usize; 4],
    draw: &[f32],
    scaling_factor: f32,
) -> Result<Vec<f32>, EngineError> {
    let rows = shape[0];
    let per_row = pixels.len() / rows.max(1);
    let (distinct, index) = distinct_rows(pixels.chunks(per_row));
    let batch = Tensor::f32("sample", vec![distinct.len(), shape[1], shape[2], shape[3]], distinct.concat());
    let out = encoder.run_tensors(&[batch])?;
    let parameters = out
        .into_iter()
        .next()
        .ok_or_else(|| EngineError::Run("vae_encoder has no output".into()))?;
    let params = &parameters.floats()?;
    let per_params = params.len() / distinct.len().max(1);
    let half = per_params / 2;
    let per_draw = draw.len() / rows.max(1);
    if half != per_draw {
        return Err(EngineError::Run(format!(
            "vae_encoder gives {half} latent values an image, the draw has {per_draw}"
        )));
    }
    let mut latents = Vec::with_capacity(rows * half);
    for (r, &d) in index.iter().enumerate() {
        let p = &params[d * per_params..(d + 1) * per_params];
        let (mean, logvar) = p.split_at(half);
        let z = &draw[r * half..(r + 1) * half];
        latents.extend(
            mean.iter()
                .zip(logvar)
                .zip(z)
                .map(|((&m, &lv), &e)| (m + (0.5 * lv.clamp(-30.0, 20.0)).exp() * e) * scaling_factor),
        );
    }
    Ok(latents)
}

fn run(e: crate::models::diffusion::schedulers::ScheduleError) -> EngineError {
    EngineError::Run(e.to_string())
}
