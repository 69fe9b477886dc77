//! A FLUX.1 or SD3 task as model inputs: the same [`SdRequest`] as the UNet families, checked
//! against what a flow pipeline runs.
//!
//! Inputs, one row per image: `clip_ids` [n, 77] (CLIP-L), SD3's `clip_ids_2` [n, 77] (CLIP-G),
//! `t5_ids` [n, L]; with SD3's classifier-free guidance the negative prompt's as `uncond_…`;
//! `latents` [n, 16, h/8, w/8] standard normal, *unpacked* (the draw diffusers makes, before
//! FLUX's 2×2 packing); `guidance` [n]. Optional, for step-level batching: `step_begin` and
//! `step_end` [n] int64, the steps each row runs (absent, every row runs every step), and for
//! rows that begin after step 0 `step_latents` [n, 16, h/8, w/8], their latents at `step_begin`
//! (an earlier call's `latents` output), as the UNet families take them.

use super::layout::{FlowFamily, FlowLayout};
use crate::engine::Tensor;
use crate::models::diffusion::request::{Draws, Mode, SdBucket, SdRequest};
use crate::models::diffusion::schedulers::Sampler;
use crate::models::diffusion::schedulers::flow_euler::FlowSchedule;

/// Classifier-free guidance: SD3 with guidance > 1 (FLUX never; dev embeds the scale).
pub fn cfg(request: &SdRequest, layout: &FlowLayout) -> bool {
    layout.family == FlowFamily::Sd3 && request.guidance_scale > 1.0
}

pub fn bucket(request: &SdRequest, layout: &FlowLayout) -> SdBucket {
    SdBucket {
        width: request.width,
        height: request.height,
        sampler: request.sampler,
        steps: request.steps,
        cfg: cfg(request, layout),
        mode: Mode::Text,
        begin: 0,
    }
}

/// Shape of one image's (unpacked) latents.
pub fn latent_dims(request: &SdRequest, layout: &FlowLayout) -> [usize; 3] {
    [
        layout.latent_channels,
        request.height / layout.vae_scale,
        request.width / layout.vae_scale,
    ]
}

/// Checks what the model imposes; the schedule the request runs.
pub fn check(request: &SdRequest, layout: &FlowLayout) -> Result<FlowSchedule, String> {
    let s = layout.size_multiple();
    let (w, h) = (request.width, request.height);
    if w == 0 || h == 0 || !w.is_multiple_of(s) || !h.is_multiple_of(s) {
        return Err(format!(
            "width and height must be positive multiples of {s} ({}: the VAE's {} × the transformer's {}x{} patches), got {w}x{h}",
            layout.family.name(),
            layout.vae_scale,
            layout.patch,
            layout.patch
        ));
    }
    if let Some(max) = layout.max_patches {
        let side = max.saturating_mul(s);
        if w > side || h > side {
            return Err(format!(
                "width and height: at most {side} for this model (its transformer's positional embedding covers {max}x{max} patches), got {w}x{h}"
            ));
        }
    }
    if request.num_images == 0 {
        return Err("num_images must be at least 1".into());
    }
    if request.sampler != Sampler::FlowEuler {
        return Err(format!(
            "sampler {:?}: {} models run the flow_euler sampler",
            request.sampler.name(),
            layout.family.name()
        ));
    }
    if request.image.is_some() {
        return Err(format!(
            "init_image: {} img2img and inpainting are not supported",
            layout.family.name()
        ));
    }
    if layout.family == FlowFamily::Flux && request.negative_prompt.is_some() {
        return Err("negative_prompt: FLUX.1 takes no negative prompt (it runs without classifier-free guidance)".into());
    }
    FlowSchedule::new(&layout.scheduler, request.steps, layout.family.sigmas(), layout.image_seq_len(w, h)).map_err(|e| e.to_string())
}

/// The model inputs from the task's standard-normal draws (`draws.noise` is unused: the flow
/// sampler draws no noise).
pub fn inputs(request: &SdRequest, layout: &FlowLayout, draws: Draws) -> Result<Vec<Tensor>, String> {
    let n = request.num_images;
    let dims = latent_dims(request, layout);
    let per: usize = dims.iter().product();
    if draws.latents.len() != n * per {
        return Err(format!(
            "initial latents have {} values, expected {n}x{dims:?}",
            draws.latents.len()
        ));
    }
    let mut inputs = prompt_inputs(request, layout)?;
    inputs.push(Tensor::f32("latents", vec![n, dims[0], dims[1], dims[2]], draws.latents));
    inputs.push(Tensor::f32("guidance", vec![n], vec![request.guidance_scale; n]));
    Ok(inputs)
}

/// Token ids, one row per image: the prompt's and, with guidance, the negative prompt's
/// (absent is `""`, as StableDiffusion3Pipeline encodes it).
fn prompt_inputs(request: &SdRequest, layout: &FlowLayout) -> Result<Vec<Tensor>, String> {
    let n = request.num_images;
    let mut texts = vec![("", request.prompt.as_str())];
    if cfg(request, layout) {
        texts.push(("uncond_", request.negative_prompt.as_deref().unwrap_or("")));
    }
    let rows = |ids: Vec<u32>| -> Vec<i64> { (0..n).flat_map(|_| ids.iter().map(|&i| i64::from(i))).collect() };
    let mut inputs = Vec::new();
    for (prefix, text) in texts {
        let clip = layout.clip.encode(text).map_err(|e| e.to_string())?;
        inputs.push(Tensor::i64(format!("{prefix}clip_ids"), vec![n, clip.len()], rows(clip)));
        if let Some(clip_2) = &layout.clip_2 {
            let ids = clip_2.encode(text).map_err(|e| e.to_string())?;
            inputs.push(Tensor::i64(format!("{prefix}clip_ids_2"), vec![n, ids.len()], rows(ids)));
        }
        let t5 = layout.t5.encode(text, layout.t5_length).map_err(|e| e.to_string())?;
        inputs.push(Tensor::i64(format!("{prefix}t5_ids"), vec![n, t5.len()], rows(t5)));
    }
    Ok(inputs)
}
