//! The flow-transformer backend (FLUX.1, SD3): text encoders, the transformer loop under
//! `flow_euler`, the VAE decoder, on one engine thread.
//!
//! The loop is step-level: each image row carries its own step index, and one transformer call
//! takes every active row at its own timestep (the exports take `timestep` [batch]). A row runs
//! steps `step_begin..step_end` (every step unless the call says otherwise), so rows that started
//! at different times share calls, and a row leaves the loop when its steps are done.
//!
//! FLUX: `hidden_states` are the 2×2-packed latents [b, (h/16)(w/16), 64], `img_ids` (0, row,
//! column) per token, `txt_ids` zeros, `timestep` σ (the pipeline's `t / 1000`), `guidance` the
//! scale (dev only); T5's `last_hidden_state` is `encoder_hidden_states`, CLIP's `pooler_output`
//! the `pooled_projections`. SD3: `hidden_states` the latents, `timestep` `t`, the hidden states
//! CLIP-L ‖ CLIP-G (penultimate layers, zero-padded to T5's width) followed by T5's along the
//! sequence, pooled CLIP-L ‖ CLIP-G projections; classifier-free guidance on `[uncond, cond]`.

use std::collections::HashMap;
use std::sync::Arc;

use super::layout::{FlowFamily, FlowLayout};
use crate::engine::{Backend, Call, ElementKind, EngineError, OrtBackend, Placement, Runtime, SessionOptions, Tensor};
use crate::models::diffusion::request::SdBucket;
use crate::models::diffusion::schedulers::flow_euler::FlowSchedule;
use crate::models::diffusion::stages::{
    Hidden, Reuse, call_outputs, decode_finished, encode, guided, input, join_features, note_cancellations, report_progress,
    resume_latents, row_owners, step_ranges, vae_decode,
};

/// Where a flow model's text encoders live (the catalog's `text_encoders`): FLUX's T5-XXL is
/// 4.7 B parameters beside a 12 B transformer, so on one GPU they compete for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EncoderPlacement {
    /// With the transformer, on the worker's device (fastest; the most device memory).
    #[default]
    Device,
    /// On the CPU, whatever the worker's device: no device memory, slower encoding.
    Cpu,
    /// On the worker's device, loaded for each call's encoding and dropped after it: the
    /// device holds them only while a call encodes, at the cost of loading them every call.
    #[value(name = "on_demand")]
    OnDemand,
}

/// The text encoders' sessions.
struct Encoders {
    clip: OrtBackend,
    /// SD3's CLIP-G.
    clip_2: Option<OrtBackend>,
    t5: OrtBackend,
}

impl Encoders {
    /// Loads the encoders where `placement` puts them (on demand: on the device, for one call).
    fn load(
        runtime: &Runtime,
        layout: &FlowLayout,
        options: &SessionOptions,
        placement: EncoderPlacement,
    ) -> Result<Encoders, EngineError> {
        match placement {
            EncoderPlacement::Device => Self::load_with(runtime, layout, options),
            EncoderPlacement::Cpu => Self::load_with(runtime, layout, &cpu(options)),
            EncoderPlacement::OnDemand => {
                // Loaded beside a transformer already on the device: a load that runs out of
                // memory is an out-of-memory error (the batch halves), not a quiet fallback to
                // the CPU as a worker's start allows.
                let mut options = options.clone();
                if let crate::engine::Device::Cuda { require, .. } = &mut options.device {
                    *require = true;
                }
                Self::load_with(runtime, layout, &options).map_err(|e| match e {
                    EngineError::Load(m) if crate::engine::is_out_of_memory(&m) => EngineError::OutOfMemory(m),
                    e => e,
                })
            }
        }
    }

    fn load_with(runtime: &Runtime, layout: &FlowLayout, options: &SessionOptions) -> Result<Encoders, EngineError> {
        let dir = &layout.dir;
        let t5 = format!("text_encoder{}/model.onnx", layout.family.t5_suffix());
        Ok(Encoders {
            clip: OrtBackend::load(runtime, &dir.join("text_encoder/model.onnx"), options)?,
            clip_2: match layout.family {
                FlowFamily::Flux => None,
                FlowFamily::Sd3 => Some(OrtBackend::load(runtime, &dir.join("text_encoder_2/model.onnx"), options)?),
            },
            t5: OrtBackend::load(runtime, &dir.join(t5), options)?,
        })
    }

    fn release_memory(&mut self) {
        self.clip.release_memory();
        if let Some(c) = self.clip_2.as_mut() {
            c.release_memory();
        }
        self.t5.release_memory();
    }
}

/// The sessions of a flow model.
pub struct FlowBackend {
    layout: Arc<FlowLayout>,
    runtime: Arc<Runtime>,
    options: SessionOptions,
    placement: EncoderPlacement,
    /// Loaded unless the placement is on demand.
    encoders: Option<Encoders>,
    transformer: OrtBackend,
    /// FLUX's `img_ids` and `txt_ids` types: int64 in Optimum's export (it casts the
    /// pipeline's float32 ids), float32 in others.
    ids: IdKinds,
    vae_decoder: OrtBackend,
    schedules: HashMap<SdBucket, Arc<FlowSchedule>>,
    /// The last call's text conditioning, for a batch's next steps.
    texts: Reuse<Text>,
}

impl FlowBackend {
    pub fn load(
        runtime: Arc<Runtime>,
        layout: Arc<FlowLayout>,
        options: &SessionOptions,
        placement: EncoderPlacement,
    ) -> Result<FlowBackend, EngineError> {
        let dir = layout.dir.clone();
        let transformer = OrtBackend::load(&runtime, &dir.join("transformer/model.onnx"), options)?;
        let ids = check_transformer(&transformer, &layout)?;
        let vae_decoder = OrtBackend::load(&runtime, &dir.join("vae_decoder/model.onnx"), options)?;
        let encoders = match placement {
            EncoderPlacement::OnDemand => None,
            _ => Some(Encoders::load(&runtime, &layout, options, placement)?),
        };
        Ok(FlowBackend {
            layout,
            runtime,
            options: options.clone(),
            placement,
            encoders,
            transformer,
            ids,
            vae_decoder,
            schedules: HashMap::new(),
            texts: Reuse::of(&[
                "clip_ids",
                "clip_ids_2",
                "t5_ids",
                "uncond_clip_ids",
                "uncond_clip_ids_2",
                "uncond_t5_ids",
            ]),
        })
    }

    fn schedule(&mut self, bucket: &SdBucket) -> Result<Arc<FlowSchedule>, EngineError> {
        if let Some(s) = self.schedules.get(bucket) {
            return Ok(s.clone());
        }
        let l = &self.layout;
        let schedule = FlowSchedule::new(
            &l.scheduler,
            bucket.steps,
            l.family.sigmas(),
            l.image_seq_len(bucket.width, bucket.height),
        )
        .map_err(|e| EngineError::Run(e.to_string()))?;
        let schedule = Arc::new(schedule);
        self.schedules.insert(bucket.clone(), schedule.clone());
        Ok(schedule)
    }

    /// The call's text conditioning, loading the encoders first when they live on demand.
    fn conditioning(&mut self, call: &Call, cfg: bool) -> Result<Text, EngineError> {
        let mut loaded = None;
        let encoders = match self.encoders.as_mut() {
            Some(e) => e,
            None => loaded.insert(Encoders::load(&self.runtime, &self.layout, &self.options, self.placement)?),
        };
        let cond = encode_prompts(encoders, &self.layout, call, "")?;
        let uncond = if cfg {
            Some(encode_prompts(encoders, &self.layout, call, "uncond_")?)
        } else {
            None
        };
        Ok(Text { cond, uncond })
    }

    /// One transformer call's inputs for the `active` rows, each at its own step `at[r]`.
    fn transformer_inputs(&self, text: &Text, x: &FlowRows, active: &[usize], schedule: &FlowSchedule, guidance: &[f32]) -> Vec<Tensor> {
        let l = &self.layout;
        let halves: Vec<&Prompts> = text.uncond.iter().chain(std::iter::once(&text.cond)).collect();
        let b = active.len() * halves.len();
        let mut hidden_states = Vec::with_capacity(b * x.per_row);
        let mut encoder_states = Vec::new();
        let mut pooled = Vec::new();
        let mut timestep = Vec::with_capacity(b);
        for half in &halves {
            for &r in active {
                hidden_states.extend_from_slice(x.row(r));
                encoder_states.extend_from_slice(half.hidden_row(r));
                pooled.extend_from_slice(half.pooled_row(r));
                let t = schedule.timestep(x.at[r]);
                timestep.push(match l.family {
                    FlowFamily::Flux => t / 1000.0,
                    FlowFamily::Sd3 => t,
                });
            }
        }
        let c = &text.cond;
        let hidden_shape = match l.family {
            FlowFamily::Flux => vec![b, x.tokens, x.per_row / x.tokens],
            FlowFamily::Sd3 => vec![b, x.dims[0], x.dims[1], x.dims[2]],
        };
        let mut inputs = vec![
            Tensor::f32("hidden_states", hidden_shape, hidden_states),
            Tensor::f32("encoder_hidden_states", vec![b, c.seq, c.dim], encoder_states),
            Tensor::f32("pooled_projections", vec![b, c.pooled_dim], pooled),
            Tensor::f32("timestep", vec![b], timestep),
        ];
        if l.family == FlowFamily::Flux {
            let ids = |name: &str, kind: ElementKind, rows: usize, values: Vec<f32>| match kind {
                ElementKind::I64 => Tensor::i64(name, vec![rows, 3], values.into_iter().map(|v| v as i64).collect()),
                _ => Tensor::f32(name, vec![rows, 3], values),
            };
            inputs.push(ids("img_ids", self.ids.img, x.tokens, image_ids(x.dims[1] / 2, x.dims[2] / 2)));
            inputs.push(ids("txt_ids", self.ids.txt, c.seq, vec![0.0; c.seq * 3]));
            if l.guidance_embeds {
                inputs.push(Tensor::f32("guidance", vec![b], active.iter().map(|&r| guidance[r]).collect()));
            }
        }
        inputs
    }
}

/// `options` with the device set to the CPU.
fn cpu(options: &SessionOptions) -> SessionOptions {
    SessionOptions {
        device: crate::engine::Device::Cpu,
        ..options.clone()
    }
}

/// The element types of FLUX's position-id inputs.
#[derive(Debug, Clone, Copy)]
struct IdKinds {
    img: ElementKind,
    txt: ElementKind,
}

/// Checks that the transformer takes what the family feeds it; the types of its position ids.
fn check_transformer(transformer: &OrtBackend, layout: &FlowLayout) -> Result<IdKinds, EngineError> {
    let inputs = transformer.inputs();
    let has = |name: &str| inputs.iter().any(|i| i.name == name);
    let mut wanted = vec!["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"];
    if layout.family == FlowFamily::Flux {
        wanted.extend(["img_ids", "txt_ids"]);
    }
    if let Some(missing) = wanted.iter().find(|n| !has(n)) {
        return Err(EngineError::Load(format!("transformer/model.onnx has no `{missing}` input")));
    }
    if has("guidance") != layout.guidance_embeds {
        return Err(EngineError::Load(format!(
            "transformer: config.json guidance_embeds is {} but the ONNX model {} a `guidance` input",
            layout.guidance_embeds,
            if has("guidance") { "has" } else { "has no" }
        )));
    }
    let mut ids = IdKinds {
        img: ElementKind::F32,
        txt: ElementKind::F32,
    };
    for i in &inputs {
        let (rank, int_ok) = match i.name.as_str() {
            "timestep" | "guidance" => (1, false),
            "img_ids" | "txt_ids" => (2, true),
            _ => continue,
        };
        let kind_ok = i.kind == ElementKind::F32 || (int_ok && i.kind == ElementKind::I64);
        if !kind_ok || i.shape.len() != rank {
            return Err(EngineError::Load(format!(
                "transformer: `{}` is {:?} of rank {}, expected float32{} of rank {rank} (an fp32 Optimum export with diffusers >= 0.31; float16 inputs are not fed)",
                i.name,
                i.kind,
                i.shape.len(),
                if int_ok { " or int64" } else { "" }
            )));
        }
        match i.name.as_str() {
            "img_ids" => ids.img = i.kind,
            "txt_ids" => ids.txt = i.kind,
            _ => {}
        }
    }
    Ok(ids)
}

/// One half (prompts or negative prompts) of a call's text conditioning, per image row.
struct Prompts {
    /// [rows, seq, dim].
    hidden: Vec<f32>,
    /// [rows, pooled_dim].
    pooled: Vec<f32>,
    seq: usize,
    dim: usize,
    pooled_dim: usize,
}

impl Prompts {
    fn hidden_row(&self, r: usize) -> &[f32] {
        let per = self.seq * self.dim;
        &self.hidden[r * per..(r + 1) * per]
    }

    fn pooled_row(&self, r: usize) -> &[f32] {
        &self.pooled[r * self.pooled_dim..(r + 1) * self.pooled_dim]
    }
}

struct Text {
    cond: Prompts,
    uncond: Option<Prompts>,
}

/// The hidden states and pooled embeddings of the `{prefix}…_ids` prompts.
fn encode_prompts(e: &mut Encoders, layout: &FlowLayout, call: &Call, prefix: &str) -> Result<Prompts, EngineError> {
    let clip_ids = input(call, &format!("{prefix}clip_ids"))?;
    let t5_ids = input(call, &format!("{prefix}t5_ids"))?;
    let rows = clip_ids.rows();
    let t5_seq = t5_ids.shape[1];
    let (t5_hidden, _) = encode(&mut e.t5, t5_ids, Hidden::Last, None)?;
    let dim = t5_hidden.len() / (rows * t5_seq).max(1);
    match layout.family {
        FlowFamily::Flux => {
            let (_, pooled) = encode(&mut e.clip, clip_ids, Hidden::Last, Some("pooler_output"))?;
            let pooled = pooled.unwrap_or_default();
            Ok(Prompts {
                hidden: t5_hidden,
                pooled_dim: pooled.len() / rows.max(1),
                pooled,
                seq: t5_seq,
                dim,
            })
        }
        FlowFamily::Sd3 => {
            let clip_2 = e
                .clip_2
                .as_mut()
                .ok_or_else(|| EngineError::Run("SD3 without its second CLIP encoder".into()))?;
            let clip_seq = clip_ids.shape[1];
            let (l, pl) = encode(&mut e.clip, clip_ids, Hidden::Penultimate, Some("text_embeds"))?;
            let (g, pg) = encode(
                clip_2,
                input(call, &format!("{prefix}clip_ids_2"))?,
                Hidden::Penultimate,
                Some("text_embeds"),
            )?;
            let clip = join_features(&l, &g, rows * clip_seq)?;
            let pooled = join_features(&pl.unwrap_or_default(), &pg.unwrap_or_default(), rows)?;
            // CLIP's tokens at T5's width, then T5's, per row.
            let clip = to_width(&clip, rows * clip_seq, dim);
            let mut hidden = Vec::with_capacity(rows * (clip_seq + t5_seq) * dim);
            for r in 0..rows {
                hidden.extend_from_slice(&clip[r * clip_seq * dim..(r + 1) * clip_seq * dim]);
                hidden.extend_from_slice(&t5_hidden[r * t5_seq * dim..(r + 1) * t5_seq * dim]);
            }
            Ok(Prompts {
                hidden,
                pooled_dim: pooled.len() / rows.max(1),
                pooled,
                seq: clip_seq + t5_seq,
                dim,
            })
        }
    }
}

/// `F.pad(x, (0, width − d))` of `tokens` rows of `d` features: zeros appended, or (a negative
/// pad) the features past `width` cut, as torch does.
fn to_width(x: &[f32], tokens: usize, width: usize) -> Vec<f32> {
    let d = x.len() / tokens.max(1);
    let kept = d.min(width);
    let mut out = Vec::with_capacity(tokens * width);
    for token in x.chunks(d.max(1)).take(tokens) {
        out.extend_from_slice(&token[..kept]);
        out.extend(std::iter::repeat_n(0.0, width - kept));
    }
    out
}

/// FLUX's `img_ids` for a `rows` × `cols` token grid: (0, row, column) per token.
fn image_ids(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|i| (0..cols).flat_map(move |j| [0.0, i as f32, j as f32]))
        .collect()
}

/// FLUX's `_pack_latents` of one image [c, h, w] → [(h/2)(w/2), 4c]: token (i, j) holds
/// channel k's 2×2 patch at feature 4k + 2a + b.
pub fn pack(latents: &[f32], [c, h, w]: [usize; 3]) -> Vec<f32> {
    let mut out = Vec::with_capacity(latents.len());
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            for k in 0..c {
                for a in 0..2 {
                    for b in 0..2 {
                        out.push(latents[k * h * w + (2 * i + a) * w + 2 * j + b]);
                    }
                }
            }
        }
    }
    out
}

/// The inverse of [`pack`] (`_unpack_latents`).
pub fn unpack(packed: &[f32], [c, h, w]: [usize; 3]) -> Vec<f32> {
    let mut out = vec![0.0; packed.len()];
    let mut values = packed.iter();
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            for k in 0..c {
                for a in 0..2 {
                    for b in 0..2 {
                        out[k * h * w + (2 * i + a) * w + 2 * j + b] = *values.next().expect("same length");
                    }
                }
            }
        }
    }
    out
}

/// The latents of a call's rows as the transformer sees them (packed for FLUX), with each row's
/// step.
struct FlowRows {
    latents: Vec<f32>,
    /// One image's unpacked latent shape [c, h, w].
    dims: [usize; 3],
    per_row: usize,
    /// Transformer tokens per row (FLUX).
    tokens: usize,
    /// The next step of each row, and the step it stops before.
    at: Vec<usize>,
    end: Vec<usize>,
}

impl FlowRows {
    fn row(&self, r: usize) -> &[f32] {
        &self.latents[r * self.per_row..(r + 1) * self.per_row]
    }
}

/// Checks a call's shapes against the model before anything runs: latents [n, c, h, w] with the
/// model's channels and even, non-zero sides (2×2 patches), and `n` rows of every other input.
fn check_call(call: &Call, layout: &FlowLayout, n: usize, [c, h, w]: [usize; 3]) -> Result<(), EngineError> {
    if n == 0 || c != layout.latent_channels || h < 2 || w < 2 || h % 2 != 0 || w % 2 != 0 {
        return Err(EngineError::Run(format!(
            "`latents` of shape [{n}, {c}, {h}, {w}]: expected {} channels and even sides of at least 2",
            layout.latent_channels
        )));
    }
    if let Some(t) = call.inputs.iter().find(|t| t.rows() != n) {
        return Err(EngineError::Run(format!("`{}` has {} rows, the latents {n}", t.name, t.rows())));
    }
    Ok(())
}

impl Backend for FlowBackend {
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
        let bucket = call
            .key
            .get::<SdBucket>()
            .cloned()
            .ok_or_else(|| EngineError::Run(format!("not a flow-transformer bucket key: {}", call.key)))?;
        let schedule = self.schedule(&bucket)?;
        let latents_in = input(call, "latents")?;
        let n = latents_in.rows();
        let latent_shape = latents_in.shape.clone();
        let dims: [usize; 3] = latent_shape[1..]
            .try_into()
            .map_err(|_| EngineError::Run(format!("`latents` of shape {latent_shape:?}: expected [n, c, h, w]")))?;
        check_call(call, &self.layout, n, dims)?;
        let per_row: usize = dims.iter().product();
        let guidance = input(call, "guidance")?.floats()?.to_vec();
        let (at, end) = step_ranges(call, n, 0, schedule.steps())?;
        let owner = row_owners(call, n)?;
        // Everything checked before the text encoders run (and, on demand, load).
        let text = match self.texts.hit(call) {
            Some(text) => text,
            None => {
                let text = self.conditioning(call, bucket.cfg)?;
                self.texts.keep(call, text)
            }
        };
        let mut start = latents_in.floats()?.to_vec();
        resume_latents(call, &at, 0, per_row, &mut start)?;
        let flux = self.layout.family == FlowFamily::Flux;
        let mut rows = FlowRows {
            latents: match flux {
                true => start.chunks(per_row).flat_map(|row| pack(row, dims)).collect(),
                false => start,
            },
            dims,
            per_row,
            tokens: (dims[1] / 2) * (dims[2] / 2),
            at,
            end,
        };
        let mut cancelled = vec![false; call.tasks.len()];
        loop {
            note_cancellations(call, &mut cancelled);
            let active: Vec<usize> = (0..n).filter(|&r| !cancelled[owner[r]] && rows.at[r] < rows.end[r]).collect();
            if active.is_empty() {
                break;
            }
            let inputs = self.transformer_inputs(&text, &rows, &active, &schedule, &guidance);
            let out = self.transformer.run_tensors(&inputs)?;
            let b = active.len();
            let halves = if text.uncond.is_some() { 2 } else { 1 };
            let pred = out
                .iter()
                .find(|t| t.name == "out_hidden_states")
                .or(out.first())
                .and_then(|t| t.f32_rows(0, b * halves))
                .filter(|p| p.len() == b * halves * per_row)
                .ok_or_else(|| EngineError::Run("transformer output is not float32 latents of the call's rows".into()))?;
            for (k, &r) in active.iter().enumerate() {
                let velocity = match halves {
                    2 => guided(
                        &pred[k * per_row..(k + 1) * per_row],
                        &pred[(b + k) * per_row..(b + k + 1) * per_row],
                        guidance[r],
                    ),
                    _ => pred[k * per_row..(k + 1) * per_row].to_vec(),
                };
                let i = rows.at[r];
                schedule
                    .step(i, &velocity, &mut rows.latents[r * per_row..(r + 1) * per_row])
                    .map_err(|e| EngineError::Run(e.to_string()))?;
                rows.at[r] += 1;
            }
            report_progress(call, &cancelled, &active, &owner, &rows.at, (0, schedule.steps()));
        }
        let finished: Vec<bool> = rows.end.iter().map(|&e| e == schedule.steps()).collect();
        let latents: Vec<f32> = match flux {
            true => rows.latents.chunks(per_row).flat_map(|row| unpack(row, dims)).collect(),
            false => rows.latents,
        };
        let l = &self.layout;
        let image_shape = vec![n, 3, dims[1] * l.vae_scale, dims[2] * l.vae_scale];
        let vae = &mut self.vae_decoder;
        let images = decode_finished(&latents, &latent_shape, &finished, image_shape[1..].iter().product(), |x, shape| {
            vae_decode(vae, x, shape, l.scaling_factor, l.shift_factor)
        })?;
        Ok(call_outputs((images, image_shape), (latents, latent_shape), &owner, &cancelled))
    }

    fn release_memory(&mut self) {
        self.texts.clear();
        if let Some(e) = self.encoders.as_mut() {
            e.release_memory();
        }
        self.transformer.release_memory();
        self.vae_decoder.release_memory();
    }

    fn placement(&self) -> Placement {
        self.transformer.placement()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_is_flux_2x2_patches_and_unpacks_back() {
        let dims = [2, 4, 6];
        let latents: Vec<f32> = (0..48).map(|v| v as f32).collect();
        let packed = pack(&latents, dims);
        // Token (0, 0): channel 0's patch then channel 1's.
        assert_eq!(&packed[..8], &[0.0, 1.0, 6.0, 7.0, 24.0, 25.0, 30.0, 31.0]);
        // Token (0, 1) starts at column 2.
        assert_eq!(packed[8], 2.0);
        assert_eq!(unpack(&packed, dims), latents);
    }

    #[test]
    fn clip_features_are_padded_or_cut_to_t5_s_width_as_f_pad() {
        let x = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(to_width(&x, 2, 3), vec![1.0, 2.0, 0.0, 3.0, 4.0, 0.0]);
        assert_eq!(to_width(&x, 2, 1), vec![1.0, 3.0]);
        assert_eq!(to_width(&x, 2, 2), x.to_vec());
    }

    #[test]
    fn image_ids_are_row_and_column() {
        assert_eq!(image_ids(2, 2), vec![0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]);
    }
}
