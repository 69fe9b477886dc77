//! A Stable Diffusion task as model inputs, and the outputs as PNGs.
//!
//! Noise is the worker's own and pinned: image `i` of a task with seed `s` starts from latents
//! drawn from stream `2i + 1` of `s` and takes its per-step noise (Euler a, LCM) from stream
//! `2i + 2`, in step order ([`crate::models::noise::Gaussian`]: ChaCha8 and a fixed ziggurat).
//! So the same record gives the same PNG bytes on the same machine and ONNX Runtime build, and
//! image `i` does not depend on how many images the task asked for. An img2img or inpainting
//! task's one VAE-encoder sampling draw (used for every encode of the task, as diffusers encodes
//! the init image once) comes from stream 0; the initial latents' stream is then the noise that
//! `add_noise` mixes into the encoded image.

use std::ops::Range;

use super::layout::{Family, SdLayout};
use super::schedulers::{Sampler, Schedule};
use crate::engine::{CallKey, Stepped, Tensor};
use crate::models::encode::{self, Image};
use crate::models::noise::Gaussian;
use crate::models::{ModelError, Render};

/// What tasks must share to run in one call; the bucket key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SdBucket {
    pub width: usize,
    pub height: usize,
    pub sampler: Sampler,
    pub steps: usize,
    /// Classifier-free guidance: the UNet runs `[uncond, cond]`.
    pub cfg: bool,
    pub mode: Mode,
    /// The first step run (img2img and inpainting start later as strength is lower).
    pub begin: usize,
}

/// What a task starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Noise.
    Text,
    /// An init image, noised to the first step run.
    Img2Img,
    /// An init image and a mask of what to repaint.
    Inpaint,
}

impl Mode {
    /// Whether the model at `layout` runs this mode: images need the export's VAE encoder, and
    /// an inpainting UNet (9 channels) serves inpainting alone.
    pub fn servable_by(self, layout: &SdLayout) -> Result<(), String> {
        let inpainting_unet = layout.unet_in_channels != layout.latent_channels;
        match self {
            Mode::Text | Mode::Img2Img if inpainting_unet => Err(format!(
                "this model's UNet takes {} channels (an inpainting UNet): it needs an init_image and a mask_image",
                layout.unet_in_channels
            )),
            Mode::Img2Img | Mode::Inpaint if !layout.has_vae_encoder => {
                Err("this model's export has no vae_encoder/: it takes no init_image".into())
            }
            _ => Ok(()),
        }
    }
}

impl SdBucket {
    /// The bucket key of a call: this, named `512x512:euler:25:cfg` (then `:img2img@1` or
    /// `:inpaint@0` with the first step run).
    /// Every diffusion backend runs its rows step by step (`step_begin`/`step_end`), and a row
    /// stopped early carries on from its `latents` and, with DPM-Solver++, `solver_previous`.
    pub fn key(self) -> CallKey {
        let pixels = (self.width * self.height) as u64;
        let first = if self.mode == Mode::Text { 0 } else { self.begin };
        let stepped = Stepped {
            steps: first..self.steps,
            carry: &[("latents", "step_latents"), ("solver_previous", "solver_previous")],
            checkpoint_every: None,
            checkpoint_seconds: None,
        };
        CallKey::new(self, Some(pixels)).stepped(stepped)
    }
}

impl std::fmt::Display for SdBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}x{}:{}:{}:{}",
            self.width,
            self.height,
            self.sampler.name(),
            self.steps,
            if self.cfg { "cfg" } else { "nocfg" }
        )?;
        match self.mode {
            Mode::Text => Ok(()),
            Mode::Img2Img => write!(f, ":img2img@{}", self.begin),
            Mode::Inpaint => write!(f, ":inpaint@{}", self.begin),
        }
    }
}

/// What an img2img or inpainting task starts from, as diffusers' image processor prepares it.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInput {
    /// The init image, [3, height, width] in [-1, 1] (`x / 255 * 2 - 1`).
    pub image: Vec<f32>,
    /// Inpainting: [height, width], 1 where the model repaints (binarized at 0.5).
    pub mask: Option<Vec<f32>>,
    /// (0, 1]: the share of the schedule that runs.
    pub strength: f64,
}

impl ImageInput {
    /// The mode and strength of an image task whose pixels are not read yet (at admission,
    /// where only its bucket is needed).
    pub fn pending(strength: f64, masked: bool) -> ImageInput {
        ImageInput {
            image: Vec::new(),
            mask: masked.then(Vec::new),
            strength,
        }
    }
}

/// The draws of one task: initial latents [images, c, h, w], per-step noise
/// [images, draws, c, h, w] (empty when the sampler draws none) and, with an init image, the
/// VAE encoder's sampling draw [c, h, w].
#[derive(Debug, Clone, PartialEq)]
pub struct Draws {
    pub latents: Vec<f32>,
    pub noise: Vec<f32>,
    pub image_noise: Option<Vec<f32>>,
}

/// One text-to-image request.
#[derive(Debug, Clone, PartialEq)]
pub struct SdRequest {
    pub prompt: String,
    /// Absent is not empty: for SDXL with `force_zeros_for_empty_prompt` an absent negative
    /// prompt gives all-zero unconditional embeddings, `""` is encoded (diffusers' rule); for
    /// SD 1.x/2.x absent is `""`.
    pub negative_prompt: Option<String>,
    pub steps: usize,
    pub guidance_scale: f32,
    pub sampler: Sampler,
    pub width: usize,
    pub height: usize,
    pub num_images: usize,
    pub seed: u64,
    /// img2img and inpainting.
    pub image: Option<ImageInput>,
}

impl SdRequest {
    /// Classifier-free guidance runs when guidance > 1 and the UNet is not guidance-distilled.
    pub fn cfg(&self, layout: &SdLayout) -> bool {
        self.guidance_scale > 1.0 && layout.time_cond_dim.is_none()
    }

    pub fn bucket(&self, layout: &SdLayout) -> SdBucket {
        SdBucket {
            width: self.width,
            height: self.height,
            sampler: self.sampler,
            steps: self.steps,
            cfg: self.cfg(layout),
            mode: self.mode(),
            begin: self.begin().unwrap_or(0),
        }
    }

    pub fn mode(&self) -> Mode {
        match &self.image {
            None => Mode::Text,
            Some(ImageInput { mask: None, .. }) => Mode::Img2Img,
            Some(_) => Mode::Inpaint,
        }
    }

    /// The first step run: `steps - min(int(steps × strength), steps)`, computed in f64 as
    /// diffusers does (f32 can lose a step). 0 without an init image.
    pub fn begin(&self) -> Result<usize, String> {
        let Some(input) = &self.image else { return Ok(0) };
        if !(input.strength > 0.0 && input.strength <= 1.0) {
            return Err(format!("strength must be in (0, 1], got {}", input.strength));
        }
        let run = ((self.steps as f64 * input.strength) as usize).min(self.steps);
        if run == 0 {
            return Err(format!(
                "strength {} of {} steps runs no step (steps × strength must be at least 1)",
                input.strength, self.steps
            ));
        }
        Ok(self.steps - run)
    }

    /// Shape of one image's latents.
    pub fn latent_dims(&self, layout: &SdLayout) -> [usize; 3] {
        [
            layout.latent_channels,
            self.height / layout.vae_scale,
            self.width / layout.vae_scale,
        ]
    }

    /// Checks what the model itself imposes (the catalog bounds are the producer's).
    pub fn check(&self, layout: &SdLayout) -> Result<Schedule, String> {
        let s = layout.size_multiple;
        if self.width == 0 || self.height == 0 || !self.width.is_multiple_of(s) || !self.height.is_multiple_of(s) {
            return Err(format!(
                "width and height must be positive multiples of {s} (this model's VAE and UNet down-sampling), got {}x{}",
                self.width, self.height
            ));
        }
        if self.num_images == 0 {
            return Err("num_images must be at least 1".into());
        }
        if self.image.is_some() && !self.sampler.takes_init_image() {
            // diffusers' LCM img2img pipeline schedules from the strength its own way; not proven.
            return Err(format!(
                "the {} sampler takes no init_image (img2img and inpainting run the other samplers)",
                self.sampler
            ));
        }
        let schedule = Schedule::new(self.sampler, &layout.scheduler, self.steps).map_err(|e| e.to_string())?;
        match self.mode() {
            Mode::Text => Ok(schedule),
            _ => schedule.beginning_at(self.begin()?).map_err(|e| e.to_string()),
        }
    }

    /// The seeded draws of the task: every image's initial latents and per-step noise, and the
    /// VAE encoder's draw when there is an init image.
    /// `dims` is one image's latent shape.
    pub fn seeded_draws(&self, dims: [usize; 3], draws: usize) -> Draws {
        let per: usize = dims.iter().product();
        let mut latents = vec![0f32; self.num_images * per];
        let mut noise = vec![0f32; self.num_images * draws * per];
        for i in 0..self.num_images {
            Gaussian::stream(self.seed, 2 * i as u64 + 1).fill(&mut latents[i * per..(i + 1) * per], 1.0);
            Gaussian::stream(self.seed, 2 * i as u64 + 2).fill(&mut noise[i * draws * per..(i + 1) * draws * per], 1.0);
        }
        let image_noise = self.image.as_ref().map(|_| {
            let mut draw = vec![0f32; per];
            Gaussian::stream(self.seed, 0).fill(&mut draw, 1.0);
            draw
        });
        Draws {
            latents,
            noise,
            image_noise,
        }
    }

    /// The token ids of the prompt (`cond_ids`) and, with guidance, of the negative prompt
    /// (`uncond_ids`), one row per image; SDXL's second tokenizer's as `cond_ids_2` and
    /// `uncond_ids_2`, and `uncond_zero` [n] (1 where the unconditional embeddings are zeros).
    fn prompt_inputs(&self, layout: &SdLayout) -> Result<Vec<Tensor>, String> {
        let n = self.num_images;
        let negative = self.negative_prompt.as_deref().unwrap_or("");
        let zeroed = self.negative_prompt.is_none() && layout.force_zeros_for_empty_prompt;
        let tokenizers = std::iter::once(("", &layout.tokenizer)).chain(layout.tokenizer_2.as_ref().map(|t| ("_2", t)));
        let mut inputs = Vec::new();
        for (suffix, tokenizer) in tokenizers {
            let ids = |text: &str| -> Result<Vec<i64>, String> {
                let ids = tokenizer.encode(text).map_err(|e| e.to_string())?;
                Ok((0..n).flat_map(|_| ids.iter().map(|&i| i as i64)).collect())
            };
            let len = tokenizer.max_length();
            inputs.push(Tensor::i64(format!("cond_ids{suffix}"), vec![n, len], ids(&self.prompt)?));
            if self.cfg(layout) {
                inputs.push(Tensor::i64(format!("uncond_ids{suffix}"), vec![n, len], ids(negative)?));
            }
        }
        if layout.family == Family::Sdxl && self.cfg(layout) {
            inputs.push(Tensor::f32("uncond_zero", vec![n], vec![if zeroed { 1.0 } else { 0.0 }; n]));
        }
        Ok(inputs)
    }

    /// The model inputs, from the task's standard-normal draws.
    pub fn inputs(&self, layout: &SdLayout, draws_of: Draws, draws: usize) -> Result<Vec<Tensor>, String> {
        let Draws {
            latents,
            noise,
            image_noise,
        } = draws_of;
        let n = self.num_images;
        let dims = self.latent_dims(layout);
        let per: usize = dims.iter().product();
        if latents.len() != n * per {
            return Err(format!("initial latents have {} values, expected {n}x{dims:?}", latents.len()));
        }
        if noise.len() != n * draws * per {
            return Err(format!("noise has {} values, expected {n}x{draws}x{dims:?}", noise.len()));
        }
        let mut inputs = self.prompt_inputs(layout)?;
        inputs.push(Tensor::f32("latents", vec![n, dims[0], dims[1], dims[2]], latents));
        if draws > 0 {
            inputs.push(Tensor::f32("noise", vec![n, draws, dims[0], dims[1], dims[2]], noise));
        }
        inputs.push(Tensor::f32("guidance", vec![n], vec![self.guidance_scale; n]));
        if let Some(input) = &self.image {
            inputs.extend(self.image_inputs(input, image_noise, per)?);
        }
        Ok(inputs)
    }

    /// An image task's inputs, one row per image: `init_image` [n, 3, H, W], `image_noise`
    /// [n, c, h, w] (the task's one VAE draw) and, inpainting, `mask` [n, 1, H, W].
    fn image_inputs(&self, input: &ImageInput, image_noise: Option<Vec<f32>>, per: usize) -> Result<Vec<Tensor>, String> {
        let (n, w, h) = (self.num_images, self.width, self.height);
        if input.image.len() != 3 * h * w || input.mask.as_ref().is_some_and(|m| m.len() != h * w) {
            return Err(format!("the init image and mask must be {w}x{h}"));
        }
        let draw = image_noise.ok_or("an image task needs its VAE-encoder draw")?;
        if draw.len() != per {
            return Err(format!("the VAE-encoder draw has {} values, expected {per}", draw.len()));
        }
        let dims = |per_row: usize| -> Vec<usize> { vec![n, per_row / (h * w).max(1), h, w] };
        let mut inputs = vec![
            Tensor::f32("init_image", dims(3 * h * w), input.image.repeat(n)),
            Tensor::f32("image_noise", vec![n, per], draw.repeat(n)),
        ];
        if let Some(mask) = &input.mask {
            inputs.push(Tensor::f32("mask", dims(h * w), mask.repeat(n)));
        }
        Ok(inputs)
    }
}

/// Turns a task's rows of `images` into PNGs.
pub struct SdRender {
    pub width: usize,
    pub height: usize,
}

impl Render for SdRender {
    fn render(&self, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, ModelError> {
        let get = |name: &str| {
            outputs
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.f32_rows(rows.start, rows.end))
                .ok_or_else(|| ModelError::Failed(format!("model output `{name}` missing")))
        };
        if get("cancelled")?.iter().any(|&c| c > 0.0) {
            return Err(ModelError::Cancelled);
        }
        let images = get("images")?;
        let (w, h) = (self.width, self.height);
        if images.len() != rows.len() * 3 * w * h {
            return Err(ModelError::Failed(format!(
                "model output has {} values, expected {}x3x{h}x{w}",
                images.len(),
                rows.len()
            )));
        }
        images
            .chunks(3 * w * h)
            .map(|chw| encode::png_rgb8(w as u32, h as u32, &to_rgb8(chw, w, h)).map_err(ModelError::Failed))
            .collect()
    }
}

/// CHW floats in [0, 1] to interleaved RGB bytes, rounded as diffusers' `numpy_to_pil`
/// (`(x * 255).round()`, half to even).
pub fn to_rgb8(chw: &[f32], width: usize, height: usize) -> Vec<u8> {
    let plane = width * height;
    let mut out = vec![0u8; 3 * plane];
    for p in 0..plane {
        for c in 0..3 {
            out[3 * p + c] = (chw[c * plane + p].clamp(0.0, 1.0) * 255.0).round_ties_even() as u8;
        }
    }
    out
}
