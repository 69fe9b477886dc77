//! The Stable Diffusion backend: text encoder, the UNet loop and the VAE decoder, three ONNX
//! Runtime sessions on one engine thread (four for SDXL: its second text encoder).
//!
//! One call is one bucket (same size, sampler, steps and guidance mode), `rows` = images. Inputs
//! per image row: `cond_ids` and (with classifier-free guidance) `uncond_ids` [n, 77] int64,
//! `latents` [n, c, h/8, w/8] standard normal, `noise` [n, draws, c, h/8, w/8] (ancestral and
//! LCM samplers), `guidance` [n]; SDXL adds `cond_ids_2`/`uncond_ids_2` (its second tokenizer)
//! and, with guidance, `uncond_zero` [n] (1: all-zero unconditional embeddings). Outputs:
//! `images` [n, 3, H, W] in [0, 1], `latents` (the final, unscaled latents), `cancelled` [n]
//! (1 for images of a task cancelled mid-loop) and, for the multistep samplers (DPM-Solver++),
//! `solver_previous` [n, c, h/8, w/8] (each row's previous prediction; zeros before its first).
//!
//! The loop is step-level, as the flow backend's: optional `step_begin`/`step_end` [n] int64 give
//! each row the steps it runs (every step of the bucket by default), so a row can stop early and
//! carry on in a later call, beside rows at other steps. A row that begins after the bucket's
//! first step takes its latents from `step_latents` and its solver state from `solver_previous`
//! (the earlier call's `latents` and `solver_previous`); its `latents`, `noise` and image inputs
//! stay the task's own (an ordinary UNet's inpainting blends with the initial noise, and the k-th
//! step run takes the k-th draw). Optimum's UNet export takes one scalar timestep, so each step
//! runs the rows that are at it as one UNet call: rows at the same step share it, rows at
//! different steps take one call each. An export given a timestep per row
//! (`scripts/unet_timestep_rows.py`) runs every row of the call in one UNet call a step.
//!
//! Every stage can run out of memory; the error goes back to the adaptive batcher, which halves
//! the batch. The VAE decode, the classic high-resolution OOM, first falls back to one image at a
//! time inside the call, so a batch whose UNet fits is not thrown away for its decode.

use std::collections::HashMap;
use std::sync::Arc;

use super::image::{ImageCall, ImageLatents};
use crate::engine::{Backend, Call, ElementKind, EngineError, InputInfo, OrtBackend, Placement, Runtime, SessionOptions, Tensor};
use crate::models::diffusion::layout::{Family, SdLayout};
use crate::models::diffusion::request::{Mode, SdBucket};
use crate::models::diffusion::schedulers::{ImageState, Schedule};
use crate::models::diffusion::stages::{
    Hidden, Reuse, call_outputs, decode_finished, encode, guided, input, join_features, note_cancellations, report_progress,
    resume_latents, row_owners, row_values, step_ranges, vae_decode,
};

/// How the UNet wants its timestep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimestepFeed {
    /// f32 or f64-free scalar `[]` (Optimum's export).
    ScalarF32,
    /// f32 `[1]` or `[batch]`.
    VectorF32 { per_row: bool },
    /// int64 `[]`, `[1]` or `[batch]` (older exports).
    I64 { rank: usize, per_row: bool },
}

impl TimestepFeed {
    fn of(inputs: &[InputInfo]) -> Result<TimestepFeed, EngineError> {
        let t = inputs
            .iter()
            .find(|i| i.name == "timestep")
            .ok_or_else(|| EngineError::Load("unet/model.onnx has no `timestep` input".into()))?;
        let per_row = t.shape.first().is_some_and(|&d| d != 1);
        match (t.kind, t.shape.len()) {
            (ElementKind::F32, 0) => Ok(TimestepFeed::ScalarF32),
            (ElementKind::F32, 1) => Ok(TimestepFeed::VectorF32 { per_row }),
            (ElementKind::I64, rank @ (0 | 1)) => Ok(TimestepFeed::I64 { rank, per_row }),
            (kind, rank) => Err(EngineError::Load(format!(
                "unet/model.onnx: timestep of type {kind:?} and rank {rank} is not supported (float32 or int64, rank 0 or 1)"
            ))),
        }
    }

    /// Whether the export takes a timestep per row, so that rows at different steps share a
    /// UNet call (an Optimum export after `scripts/unet_timestep_rows.py`).
    fn per_row(self) -> bool {
        matches!(
            self,
            TimestepFeed::VectorF32 { per_row: true } | TimestepFeed::I64 { rank: 1, per_row: true }
        )
    }

    /// The `timestep` input of a UNet call whose rows are at timesteps `ts`: one value for an
    /// export that takes one (the rows are then all at the same step), or one a row.
    fn tensor(self, ts: &[f32]) -> Tensor {
        let (t, batch) = (ts.first().copied().unwrap_or_default(), ts.len());
        debug_assert!(self.per_row() || ts.iter().all(|&x| x == t), "rows at different steps share a call");
        match self {
            TimestepFeed::ScalarF32 => Tensor::f32("timestep", vec![], vec![t]),
            TimestepFeed::VectorF32 { per_row } => match per_row {
                true => Tensor::f32("timestep", vec![batch], ts.to_vec()),
                false => Tensor::f32("timestep", vec![1], vec![t]),
            },
            TimestepFeed::I64 { rank, per_row } => {
                let values: Vec<i64> = match per_row {
                    true => ts.iter().map(|&x| x as i64).collect(),
                    false => vec![t as i64],
                };
                let shape = if rank == 0 { vec![] } else { vec![values.len()] };
                Tensor::i64("timestep", shape, values)
            }
        }
    }
}

/// The sessions of a model, loaded on one engine thread.
pub struct SdBackend {
    layout: Arc<SdLayout>,
    text_encoder: OrtBackend,
    /// SDXL's second text encoder (with a projection: its `text_embeds` are the pooled input).
    text_encoder_2: Option<OrtBackend>,
    unet: OrtBackend,
    /// Channels of the UNet's `sample`: the latent channels, or 9 for an inpainting UNet
    /// (latents, mask, masked-image latents).
    unet_channels: usize,
    vae_decoder: OrtBackend,
    /// For img2img and inpainting; loaded when the export has one.
    vae_encoder: Option<OrtBackend>,
    timestep: TimestepFeed,
    /// The last call's text conditioning and image latents, for a batch's next steps.
    texts: Reuse<Conditioning>,
    images: Reuse<ImageLatents>,
    schedules: HashMap<SdBucket, Arc<Schedule>>,
}

impl SdBackend {
    pub fn load(
        runtime: &Runtime,
        layout: Arc<SdLayout>,
        dir: &std::path::Path,
        options: &SessionOptions,
    ) -> Result<SdBackend, EngineError> {
        let text_encoder = OrtBackend::load(runtime, &dir.join("text_encoder/model.onnx"), options)?;
        let text_encoder_2 = match layout.family {
            Family::Sd => None,
            Family::Sdxl => Some(OrtBackend::load(runtime, &dir.join("text_encoder_2/model.onnx"), options)?),
        };
        let unet = OrtBackend::load(runtime, &dir.join("unet/model.onnx"), options)?;
        let vae_decoder = OrtBackend::load(runtime, &dir.join("vae_decoder/model.onnx"), options)?;
        let encoder = dir.join("vae_encoder/model.onnx");
        let vae_encoder = match encoder.is_file() {
            true => Some(OrtBackend::load(runtime, &encoder, options)?),
            false => None,
        };
        let unet_inputs = unet.inputs();
        // unet/config.json's in_channels, which admission judges by, and the export's `sample`
        // (when its channel dimension is fixed) must agree.
        let unet_channels = layout.unet_in_channels;
        let exported = unet_inputs
            .iter()
            .find(|i| i.name == "sample")
            .and_then(|i| i.shape.get(1).copied())
            .and_then(|c| usize::try_from(c).ok());
        if exported.is_some_and(|c| c != unet_channels)
            || (unet_channels != layout.latent_channels && unet_channels != 2 * layout.latent_channels + 1)
        {
            return Err(EngineError::Load(format!(
                "unet: in_channels {unet_channels} (config.json), `sample` channels {exported:?} (model.onnx); expected {} (the latents) or {} (an inpainting UNet), the same in both",
                layout.latent_channels,
                2 * layout.latent_channels + 1
            )));
        }
        let timestep = TimestepFeed::of(&unet_inputs)?;
        let has_cond = unet_inputs.iter().any(|i| i.name == "timestep_cond");
        if has_cond != layout.time_cond_dim.is_some() {
            return Err(EngineError::Load(format!(
                "unet: config.json time_cond_proj_dim is {:?} but the ONNX model {} a `timestep_cond` input",
                layout.time_cond_dim,
                if has_cond { "has" } else { "has no" }
            )));
        }
        let has_added = ["text_embeds", "time_ids"].map(|name| unet_inputs.iter().any(|i| i.name == name));
        if has_added != [layout.family == Family::Sdxl; 2] {
            return Err(EngineError::Load(format!(
                "unet: a {:?} model, but its `text_embeds` and `time_ids` inputs are {has_added:?} (SDXL's UNet takes both, SD 1.x/2.x's neither)",
                layout.family
            )));
        }
        Ok(SdBackend {
            layout,
            text_encoder,
            text_encoder_2,
            unet,
            unet_channels,
            vae_decoder,
            vae_encoder,
            timestep,
            texts: Reuse::of(&["cond_ids", "uncond_ids", "cond_ids_2", "uncond_ids_2", "uncond_zero", "guidance"]),
            images: Reuse::of(&["init_image", "mask", "image_noise"]),
            schedules: HashMap::new(),
        })
    }

    fn schedule(&mut self, bucket: &SdBucket) -> Result<Arc<Schedule>, EngineError> {
        if let Some(s) = self.schedules.get(bucket) {
            return Ok(s.clone());
        }
        let run = |e: crate::models::diffusion::schedulers::ScheduleError| EngineError::Run(e.to_string());
        let mut schedule = Schedule::new(bucket.sampler, &self.layout.scheduler, bucket.steps).map_err(run)?;
        if bucket.mode != Mode::Text {
            schedule = schedule.beginning_at(bucket.begin).map_err(run)?;
        }
        let schedule = Arc::new(schedule);
        self.schedules.insert(bucket.clone(), schedule.clone());
        Ok(schedule)
    }

    /// Decodes unscaled latents [n, ...] to images in [0, 1].
    fn decode(&mut self, latents: &[f32], shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        vae_decode(&mut self.vae_decoder, latents, shape, self.layout.scaling_factor, 0.0)
    }
}

/// `get_guidance_scale_embedding(w, dim)` of diffusers' LCM pipeline: sin then cos of
/// `w * 1000 * exp(-ln(10000) k / (dim/2 - 1))`.
pub fn guidance_embedding(w: f32, dim: usize) -> Vec<f32> {
    let w = w * 1000.0;
    let half = dim / 2;
    let factor = -(10000f32.ln()) / (half as f32 - 1.0);
    let freqs: Vec<f32> = (0..half).map(|k| (k as f32 * factor).exp()).collect();
    let mut emb: Vec<f32> = freqs.iter().map(|f| (w * f).sin()).collect();
    emb.extend(freqs.iter().map(|f| (w * f).cos()));
    emb.resize(dim, 0.0);
    emb
}

impl Backend for SdBackend {
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
        let bucket = call
            .key
            .get::<SdBucket>()
            .cloned()
            .ok_or_else(|| EngineError::Run(format!("not a stable diffusion bucket key: {}", call.key)))?;
        let schedule = self.schedule(&bucket)?;
        let latents_in = input(call, "latents")?;
        let n = latents_in.rows();
        let latent_shape = latents_in.shape.clone();
        let per_image: usize = latent_shape[1..].iter().product();
        let guidance = input(call, "guidance")?.floats()?.to_vec();
        let text = match self.texts.hit(call) {
            Some(text) => text,
            None => {
                let text = self.conditioning(call, &bucket, n, &guidance)?;
                self.texts.keep(call, text)
            }
        };
        let noise = if schedule.noise_draws() > 0 {
            Some(input(call, "noise")?.floats()?)
        } else {
            None
        };
        let draws = schedule.noise_draws();
        let image = match bucket.mode {
            Mode::Text => None,
            mode => Some(match self.images.hit(call) {
                Some(image) => image,
                None => {
                    let image = self.image_latents(call, mode, bucket.begin, n, per_image)?;
                    self.images.keep(call, image)
                }
            }),
        };
        let start = latents_in.floats()?;
        let (first, steps) = (schedule.begin(), schedule.timesteps().len());
        let (mut at, end) = step_ranges(call, n, first, steps)?;
        let mut rows = Rows {
            latents: match &image {
                Some(image) => image.initial(&schedule, start)?,
                None => start.iter().map(|v| v * schedule.init_noise_sigma()).collect(),
            },
            states: vec![ImageState::default(); n],
            per_image,
            noise,
            draws,
        };
        rows.resume(call, &schedule, &at)?;
        let owner = row_owners(call, n)?;
        let mut cancelled = vec![false; call.tasks.len()];
        let mut unet_shape = latent_shape.clone();
        unet_shape[1] = self.unet_channels;
        loop {
            note_cancellations(call, &mut cancelled);
            let active: Vec<usize> = (0..n).filter(|&r| !cancelled[owner[r]] && at[r] < end[r]).collect();
            if active.is_empty() {
                break;
            }
            // An export that takes a timestep per row runs every active row in one UNet call,
            // whatever step each is at. One that takes a single timestep (Optimum's is a scalar)
            // runs the rows at each step together: one UNet call per step the rows are at.
            let groups: Vec<Vec<usize>> = if self.timestep.per_row() {
                vec![active.clone()]
            } else {
                let mut at_steps: Vec<usize> = active.iter().map(|&r| at[r]).collect();
                at_steps.sort_unstable();
                at_steps.dedup();
                at_steps
                    .into_iter()
                    .map(|i| active.iter().copied().filter(|&r| at[r] == i).collect())
                    .collect()
            };
            for group in groups {
                let steps: Vec<usize> = group.iter().map(|&r| at[r]).collect();
                self.unet_step(
                    &schedule,
                    (&group, &steps),
                    &mut rows,
                    &text,
                    &guidance,
                    (&unet_shape, &latent_shape),
                    image.as_deref(),
                    start,
                )?;
                for &r in &group {
                    at[r] += 1;
                }
            }
            report_progress(call, &cancelled, &active, &owner, &at, (first, steps));
        }
        let previous = schedule.multistep().then(|| rows.previous());
        let latents = rows.latents;

        let finished: Vec<bool> = end.iter().map(|&e| e == steps).collect();
        let image_shape = [
            n,
            3,
            latent_shape[2] * self.layout.vae_scale,
            latent_shape[3] * self.layout.vae_scale,
        ];
        let images = decode_finished(&latents, &latent_shape, &finished, image_shape[1..].iter().product(), |l, shape| {
            self.decode(l, shape)
        })?;
        let mut outputs = call_outputs((images, image_shape.to_vec()), (latents, latent_shape.clone()), &owner, &cancelled);
        outputs.extend(previous.map(|p| Tensor::f32("solver_previous", latent_shape, p)));
        Ok(outputs)
    }

    fn release_memory(&mut self) {
        self.texts.clear();
        self.images.clear();
        if let Some(encoder) = self.vae_encoder.as_mut() {
            encoder.release_memory();
        }
        self.text_encoder.release_memory();
        if let Some(second) = self.text_encoder_2.as_mut() {
            second.release_memory();
        }
        self.unet.release_memory();
        self.vae_decoder.release_memory();
    }

    fn placement(&self) -> Placement {
        self.unet.placement()
    }
}

/// A call's text conditioning, per image row: the prompts' hidden states, the negative prompts'
/// when guidance runs the UNet on `[uncond, cond]`, the guidance-scale embedding of models
/// distilled with it (LCM), and SDXL's added conditions.
struct Conditioning {
    cond: Vec<f32>,
    uncond: Option<Vec<f32>>,
    /// Hidden-state values of one row, and its sequence length.
    per_row: usize,
    seq: usize,
    /// `timestep_cond` rows, `dim` values each.
    time_cond: Option<(Vec<f32>, usize)>,
    /// SDXL's `text_embeds` and `time_ids`.
    added: Option<Added>,
}

/// SDXL's added conditions: the second encoder's pooled embeddings (`text_embeds`), per row and
/// per half of the guidance batch, and the size conditioning `time_ids`, the same for every row
/// of a call (original size, crop top-left (0, 0), target size).
struct Added {
    pooled: Vec<f32>,
    uncond_pooled: Option<Vec<f32>>,
    dim: usize,
    time_ids: [f32; 6],
}

impl SdBackend {
    /// Encodes a call's prompts (and negative prompts with guidance) on the text encoders; `rows`
    /// image rows of `bucket`.
    fn conditioning(&mut self, call: &Call, bucket: &SdBucket, rows: usize, guidance: &[f32]) -> Result<Conditioning, EngineError> {
        let seq = input(call, "cond_ids")?.shape[1];
        let (cond, pooled) = self.encode_prompts(call, "cond", rows * seq)?;
        let (mut uncond, mut uncond_pooled) = match bucket.cfg {
            true => {
                let (hidden, pooled) = self.encode_prompts(call, "uncond", rows * seq)?;
                (Some(hidden), pooled)
            }
            false => (None, None),
        };
        if let (Some(uncond), Ok(zero)) = (uncond.as_mut(), input(call, "uncond_zero")) {
            // SDXL's force_zeros_for_empty_prompt: rows whose negative prompt is absent.
            zero_rows(uncond, zero.floats()?);
            if let Some(p) = uncond_pooled.as_mut() {
                zero_rows(p, zero.floats()?);
            }
        }
        let time_cond = self
            .layout
            .time_cond_dim
            .map(|dim| (guidance.iter().flat_map(|&g| guidance_embedding(g - 1.0, dim)).collect(), dim));
        let added = pooled.map(|pooled| {
            let (h, w) = (bucket.height as f32, bucket.width as f32);
            Added {
                dim: pooled.len() / rows,
                pooled,
                uncond_pooled: uncond_pooled.take(),
                time_ids: [h, w, 0.0, 0.0, h, w],
            }
        });
        Ok(Conditioning {
            per_row: cond.len() / rows,
            cond,
            uncond,
            seq,
            time_cond,
            added,
        })
    }

    /// The hidden states [rows, seq, D] of the `{which}_ids` prompts (`tokens` = rows × seq) and,
    /// for SDXL, their pooled embeddings: both encoders' penultimate states joined, the second's
    /// `text_embeds`.
    fn encode_prompts(&mut self, call: &Call, which: &str, tokens: usize) -> Result<(Vec<f32>, Option<Vec<f32>>), EngineError> {
        let ids = input(call, &format!("{which}_ids"))?;
        match &mut self.text_encoder_2 {
            None => encode(&mut self.text_encoder, ids, Hidden::Last, None),
            Some(second) => {
                let (first_hidden, _) = encode(&mut self.text_encoder, ids, Hidden::Penultimate, None)?;
                let (second_hidden, pooled) = encode(
                    second,
                    input(call, &format!("{which}_ids_2"))?,
                    Hidden::Penultimate,
                    Some("text_embeds"),
                )?;
                Ok((join_features(&first_hidden, &second_hidden, tokens)?, pooled))
            }
        }
    }

    /// One UNet call's inputs for the `active` rows at timesteps `ts` (one a row): `sample`
    /// (their scaled latents) twice over with guidance, the timesteps, the hidden states
    /// `[uncond..., cond...]`, and `timestep_cond` where the model has it. Returns them with the
    /// call's row count.
    fn unet_inputs(
        &self,
        text: &Conditioning,
        active: &[usize],
        sample: Vec<f32>,
        latent_shape: &[usize],
        ts: &[f32],
    ) -> (Vec<Tensor>, usize) {
        let per_row = text.per_row;
        let mut hidden = Vec::new();
        let (sample, rows) = match &text.uncond {
            Some(uncond) => {
                for &r in active {
                    hidden.extend_from_slice(&uncond[r * per_row..(r + 1) * per_row]);
                }
                ([sample.clone(), sample].concat(), 2 * active.len())
            }
            None => (sample, active.len()),
        };
        for &r in active {
            hidden.extend_from_slice(&text.cond[r * per_row..(r + 1) * per_row]);
        }
        let mut shape = latent_shape.to_vec();
        shape[0] = rows;
        let ts = match text.uncond {
            Some(_) => [ts, ts].concat(),
            None => ts.to_vec(),
        };
        let mut inputs = vec![
            Tensor::f32("sample", shape, sample),
            self.timestep.tensor(&ts),
            Tensor::f32("encoder_hidden_states", vec![rows, text.seq, per_row / text.seq], hidden),
        ];
        if let Some((tc, dim)) = &text.time_cond {
            let dim = *dim;
            let rows_tc: Vec<f32> = active.iter().flat_map(|&r| tc[r * dim..(r + 1) * dim].iter().copied()).collect();
            let rows_tc = if text.uncond.is_some() {
                [rows_tc.clone(), rows_tc].concat()
            } else {
                rows_tc
            };
            inputs.push(Tensor::f32("timestep_cond", vec![rows, dim], rows_tc));
        }
        if let Some(added) = &text.added {
            let dim = added.dim;
            let mut pooled = Vec::with_capacity(rows * dim);
            for half in [added.uncond_pooled.as_ref(), Some(&added.pooled)].into_iter().flatten() {
                for &r in active {
                    pooled.extend_from_slice(&half[r * dim..(r + 1) * dim]);
                }
            }
            inputs.push(Tensor::f32("text_embeds", vec![rows, dim], pooled));
            inputs.push(Tensor::f32("time_ids", vec![rows, 6], added.time_ids.repeat(rows)));
        }
        (inputs, rows)
    }

    /// An img2img or inpainting call's image conditioning (`mode` is not text).
    fn image_latents(&mut self, call: &Call, mode: Mode, begin: usize, rows: usize, per_image: usize) -> Result<ImageLatents, EngineError> {
        let encoder = self
            .vae_encoder
            .as_mut()
            .ok_or_else(|| EngineError::Run("img2img and inpainting need the export's vae_encoder/model.onnx".into()))?;
        let draw = input(call, "image_noise")?.floats()?;
        if draw.len() != rows * per_image {
            return Err(EngineError::Run(format!(
                "`image_noise` has {} values, expected {rows}x{per_image}",
                draw.len()
            )));
        }
        let call = ImageCall {
            image: input(call, "init_image")?,
            draw,
            mask: match mode {
                Mode::Inpaint => Some(input(call, "mask")?),
                _ => None,
            },
            begin,
            mask_channels: self.unet_channels != self.layout.latent_channels,
            scaling_factor: self.layout.scaling_factor,
            vae_scale: self.layout.vae_scale,
        };
        ImageLatents::encode(encoder, call)
    }

    /// One step of each of the `group` rows, the row at `steps` (all the same step unless the
    /// export takes a timestep per row): the UNet on their latents, guidance, the sampler's
    /// step, and an ordinary UNet's inpainting blend.
    #[allow(clippy::too_many_arguments)]
    fn unet_step(
        &mut self,
        schedule: &Schedule,
        (group, steps): (&[usize], &[usize]),
        rows: &mut Rows<'_>,
        text: &Conditioning,
        guidance: &[f32],
        (unet_shape, latent_shape): (&[usize], &[usize]),
        image: Option<&ImageLatents>,
        start: &[f32],
    ) -> Result<(), EngineError> {
        let (b, per_image) = (group.len(), rows.per_image);
        let mut sample = rows.model_input(schedule, steps, group)?;
        let mask_channels = self.unet_channels != latent_shape[1];
        if let Some(image) = image.filter(|_| mask_channels) {
            sample = image.with_mask_channels(&sample, group, per_image);
        }
        let ts: Vec<f32> = steps.iter().map(|&i| schedule.timesteps()[i]).collect();
        let (inputs, unet_rows) = self.unet_inputs(text, group, sample, unet_shape, &ts);
        let out = self.unet.run_tensors(&inputs)?;
        let pred = out
            .iter()
            .find(|t| t.name == "out_sample")
            .or(out.first())
            .and_then(|t| t.f32_rows(0, unet_rows))
            .ok_or_else(|| EngineError::Run("unet output is not float32".into()))?;
        rows.step(schedule, steps, group, |k, r| {
            if text.uncond.is_some() {
                let uncond = &pred[k * per_image..(k + 1) * per_image];
                let cond = &pred[(b + k) * per_image..(b + k + 1) * per_image];
                guided(uncond, cond, guidance[r])
            } else {
                pred[k * per_image..(k + 1) * per_image].to_vec()
            }
        })?;
        if let Some(image) = image.filter(|_| !mask_channels) {
            for (&r, &i) in group.iter().zip(steps) {
                image.blend_known_region(schedule, i, &mut rows.latents, &[r], start)?;
            }
        }
        Ok(())
    }
}

/// The latents of a call's image rows as the denoising loop advances them, with each row's
/// sampler state and its noise draws.
struct Rows<'a> {
    latents: Vec<f32>,
    states: Vec<ImageState>,
    /// Latent values of one row.
    per_image: usize,
    /// `draws` draws per row, for samplers that add noise.
    noise: Option<&'a [f32]>,
    draws: usize,
}

impl Rows<'_> {
    /// Rows that begin after the schedule's first step carry on from where an earlier call left
    /// them: their latents from `step_latents` and, for the multistep solver, its previous
    /// prediction from `solver_previous` (both [n, c, h, w], the earlier call's `latents` and
    /// `solver_previous`). Their noise draws are the task's, indexed by step.
    fn resume(&mut self, call: &Call, schedule: &Schedule, at: &[usize]) -> Result<(), EngineError> {
        let (first, per_image) = (schedule.begin(), self.per_image);
        resume_latents(call, at, first, per_image, &mut self.latents)?;
        if !schedule.multistep() || at.iter().all(|&i| i == first) {
            return Ok(());
        }
        let previous = row_values(call, "solver_previous", at.len(), per_image)?;
        for (r, &i) in at.iter().enumerate().filter(|&(_, &i)| i > first) {
            let span = r * per_image..(r + 1) * per_image;
            self.states[r] = ImageState::resumed(Some(previous[span].to_vec()), i - first);
        }
        Ok(())
    }

    /// Each row's multistep state, zeros for a row that has none yet.
    fn previous(&self) -> Vec<f32> {
        let zeros = vec![0.0; self.per_image];
        self.states
            .iter()
            .flat_map(|s| s.previous().unwrap_or(&zeros).iter().copied())
            .collect()
    }

    /// The `active` rows' latents, each scaled for the model at its step of `steps`.
    fn model_input(&self, schedule: &Schedule, steps: &[usize], active: &[usize]) -> Result<Vec<f32>, EngineError> {
        let per_image = self.per_image;
        let mut sample = Vec::with_capacity(active.len() * per_image);
        for (&r, &i) in active.iter().zip(steps) {
            let mut x = self.latents[r * per_image..(r + 1) * per_image].to_vec();
            schedule.scale_model_input(i, &mut x).map_err(|e| EngineError::Run(e.to_string()))?;
            sample.extend(x);
        }
        Ok(sample)
    }

    /// One sampler step of each active row at its step of `steps`, from the model output
    /// `output(k, r)` for the row `r`, the `k`-th of the call.
    fn step(
        &mut self,
        schedule: &Schedule,
        steps: &[usize],
        active: &[usize],
        output: impl Fn(usize, usize) -> Vec<f32>,
    ) -> Result<(), EngineError> {
        let (per_image, draws) = (self.per_image, self.draws);
        for (k, (&r, &i)) in active.iter().zip(steps).enumerate() {
            let draws_now = schedule.draws_noise(i);
            let model_output = output(k, r);
            let step_noise = match (draws_now, self.noise) {
                (true, Some(noise)) => {
                    let at = r * draws + schedule.draw_index(i);
                    Some(&noise[at * per_image..(at + 1) * per_image])
                }
                _ => None,
            };
            schedule
                .step(
                    i,
                    &model_output,
                    &mut self.latents[r * per_image..(r + 1) * per_image],
                    step_noise,
                    &mut self.states[r],
                )
                .map_err(|e| EngineError::Run(e.to_string()))?;
        }
        Ok(())
    }
}

/// Zeroes the rows of `values` (equal parts, one per entry of `zero`) whose flag is set.
fn zero_rows(values: &mut [f32], zero: &[f32]) {
    if zero.is_empty() {
        return;
    }
    let per = values.len() / zero.len();
    for (row, &z) in values.chunks_mut(per.max(1)).zip(zero) {
        if z > 0.0 {
            row.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> (Vec<usize>, Vec<f32>) {
        match &t.data {
            crate::engine::TensorData::F32(v) => (t.shape.clone(), v.clone()),
            crate::engine::TensorData::I64(v) => (t.shape.clone(), v.iter().map(|&x| x as f32).collect()),
        }
    }

    fn timestep(kind: ElementKind, shape: Vec<i64>) -> TimestepFeed {
        TimestepFeed::of(&[InputInfo {
            name: "timestep".into(),
            kind,
            shape,
        }])
        .unwrap()
    }

    /// Optimum's scalar takes one timestep a call; a dynamic vector (the export after
    /// `scripts/unet_timestep_rows.py`) one a row, so rows at different steps share a call.
    #[test]
    fn a_dynamic_timestep_vector_takes_a_timestep_per_row_and_a_scalar_one_a_call() {
        let scalar = timestep(ElementKind::F32, vec![]);
        assert!(!scalar.per_row());
        assert_eq!(values(&scalar.tensor(&[981.0, 981.0])), (vec![], vec![981.0]));
        assert!(!timestep(ElementKind::F32, vec![1]).per_row());

        let rows = timestep(ElementKind::F32, vec![-1]);
        assert!(rows.per_row());
        let ts = [981.0, 21.0, 981.0, 21.0];
        assert_eq!(values(&rows.tensor(&ts)), (vec![4], ts.to_vec()));
        let rows = timestep(ElementKind::I64, vec![-1]);
        assert!(rows.per_row());
        assert_eq!(values(&rows.tensor(&ts)), (vec![4], ts.to_vec()));
        assert!(!timestep(ElementKind::I64, vec![]).per_row());
    }
}
