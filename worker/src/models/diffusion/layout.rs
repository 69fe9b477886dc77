//! A Stable Diffusion model directory in the Optimum ONNX layout (what `optimum-cli export onnx
//! --task text-to-image` writes), read without loading any session:
//!
//! ```text
//! model_index.json
//! scheduler/scheduler_config.json
//! tokenizer/{vocab.json, merges.txt, tokenizer_config.json}
//! text_encoder/model.onnx          (+ model.onnx_data when exported with external data)
//! unet/{model.onnx, config.json}   (+ model.onnx_data)
//! vae_decoder/{model.onnx, config.json}
//! ```
//!
//! SDXL (`StableDiffusionXLPipeline` in `model_index.json`, or a `text_encoder_2/`) adds
//! `text_encoder_2/model.onnx` and `tokenizer_2/`, and its UNet takes `text_embeds` and
//! `time_ids`.

use std::path::{Path, PathBuf};

use thiserror::Error;

use super::schedulers::{ScheduleError, SchedulerConfig};
use super::tokenizer::{ClipTokenizer, TokenizerError};

/// Files a Stable Diffusion directory must have, relative to it.
pub const REQUIRED_FILES: [&str; 9] = [
    "scheduler/scheduler_config.json",
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer_config.json",
    "text_encoder/model.onnx",
    "unet/model.onnx",
    "unet/config.json",
    "vae_decoder/model.onnx",
    "vae_decoder/config.json",
];

/// Files an SDXL directory has besides [`REQUIRED_FILES`].
pub const SDXL_FILES: [&str; 4] = [
    "text_encoder_2/model.onnx",
    "tokenizer_2/vocab.json",
    "tokenizer_2/merges.txt",
    "tokenizer_2/tokenizer_config.json",
];

/// Which pipeline a model directory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Stable Diffusion 1.x/2.x, SD-Turbo, LCM: one CLIP text encoder, its last hidden state.
    Sd,
    /// SDXL and SDXL-Turbo: two text encoders, their penultimate hidden states joined, the second
    /// one's pooled embedding and the size conditioning (`time_ids`) into the UNet.
    Sdxl,
}

#[derive(Debug, Error)]
pub enum LayoutError {
    #[error("{dir}: {file} is missing (expected the Optimum ONNX layout: optimum-cli export onnx --task text-to-image)")]
    Missing { dir: String, file: String },
    #[error("{file}: {reason}")]
    Config { file: String, reason: String },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Scheduler(#[from] ScheduleError),
    /// A catalog setting the model cannot run with.
    #[error("catalog: {0}")]
    Setting(String),
}

/// What the CPU side of the pipeline needs from a model directory.
pub struct SdLayout {
    pub dir: PathBuf,
    pub family: Family,
    pub tokenizer: ClipTokenizer,
    /// SDXL's second tokenizer (pads with `!`).
    pub tokenizer_2: Option<ClipTokenizer>,
    /// SDXL: an absent negative prompt gives all-zero unconditional embeddings
    /// (`model_index.json` `force_zeros_for_empty_prompt`, true unless it says otherwise).
    pub force_zeros_for_empty_prompt: bool,
    pub scheduler: SchedulerConfig,
    /// `vae_decoder/config.json` `scaling_factor` (0.18215 for SD 1.x/2.x, 0.13025 for SDXL).
    pub scaling_factor: f32,
    /// Pixels per latent along each axis: 2^(VAE blocks - 1), 8 for every SD.
    pub vae_scale: usize,
    /// What a width or height must be a multiple of: `vae_scale` × 2^(UNet blocks - 1) (64 for
    /// SD 1.x/2.x). An ONNX export traced at one size up-samples by fixed factors, so a latent
    /// side the UNet's down-sampling does not divide fails in its skip connections.
    pub size_multiple: usize,
    pub latent_channels: usize,
    /// `time_cond_proj_dim` of a guidance-distilled (LCM) UNet: guidance goes in as an
    /// embedding and classifier-free guidance is off.
    pub time_cond_dim: Option<usize>,
    /// `unet/config.json` `in_channels`: the latent channels, or 2 × them + 1 for an inpainting
    /// UNet (latents, mask, masked-image latents), which serves inpainting alone.
    pub unet_in_channels: usize,
    /// Whether the export has `vae_encoder/` (img2img and inpainting need it).
    pub has_vae_encoder: bool,
}

impl SdLayout {
    /// Checks every required file and reads the configs and the tokenizers.
    pub fn open(dir: &Path) -> Result<SdLayout, LayoutError> {
        let index = model_index(dir)?;
        let xl_class = index["_class_name"].as_str().is_some_and(|c| c.contains("StableDiffusionXL"));
        let family = if xl_class || dir.join("text_encoder_2").is_dir() {
            Family::Sdxl
        } else {
            Family::Sd
        };
        let extra: &[&str] = match family {
            Family::Sd => &[],
            Family::Sdxl => &SDXL_FILES,
        };
        require(dir, REQUIRED_FILES.iter().chain(extra))?;
        let json = |file: &str| config(dir, file);
        let scheduler = scheduler_config(dir)?;
        let vae = json("vae_decoder/config.json")?;
        let unet = json("unet/config.json")?;
        let scaling_factor = vae["scaling_factor"].as_f64().unwrap_or(0.18215) as f32;
        let latent_channels = vae["latent_channels"]
            .as_u64()
            .or_else(|| unet["in_channels"].as_u64().filter(|&c| c <= 4))
            .unwrap_or(4) as usize;
        let unet_blocks = unet["block_out_channels"].as_array().map_or(4, |b| b.len());
        let vae_scale = vae_scale(&vae);
        let time_cond_dim = unet["time_cond_proj_dim"].as_u64().map(|d| d as usize);
        Ok(SdLayout {
            dir: dir.to_owned(),
            family,
            tokenizer: ClipTokenizer::load(&dir.join("tokenizer"))?,
            tokenizer_2: match family {
                Family::Sd => None,
                Family::Sdxl => Some(ClipTokenizer::load(&dir.join("tokenizer_2"))?),
            },
            force_zeros_for_empty_prompt: family == Family::Sdxl && index["force_zeros_for_empty_prompt"].as_bool().unwrap_or(true),
            scheduler,
            scaling_factor,
            vae_scale,
            size_multiple: vae_scale << unet_blocks.clamp(1, 8).saturating_sub(1),
            latent_channels,
            time_cond_dim,
            unet_in_channels: unet["in_channels"].as_u64().map_or(latent_channels, |c| c as usize),
            has_vae_encoder: dir.join("vae_encoder/model.onnx").is_file(),
        })
    }
}

/// `dir`'s `model_index.json`, as Python's json writes it; `Null` when there is none.
pub(super) fn model_index(dir: &Path) -> Result<serde_json::Value, LayoutError> {
    match dir.join("model_index.json").is_file() {
        true => config(dir, "model_index.json"),
        false => Ok(serde_json::Value::Null),
    }
}

/// The JSON file `file` of `dir`, as Python's json writes it.
pub(super) fn config(dir: &Path, file: &str) -> Result<serde_json::Value, LayoutError> {
    let path = dir.join(file);
    std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| super::python_json::parse(&t).map_err(|e| e.to_string()))
        .map_err(|reason| LayoutError::Config {
            file: path.display().to_string(),
            reason,
        })
}

/// `scheduler/scheduler_config.json`, as the samplers read it.
pub(super) fn scheduler_config(dir: &Path) -> Result<SchedulerConfig, LayoutError> {
    let file = dir.join("scheduler/scheduler_config.json");
    let text = std::fs::read_to_string(&file).map_err(|e| LayoutError::Config {
        file: file.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(SchedulerConfig::from_json(&text)?)
}

/// Fails naming the first of `files` that `dir` lacks.
pub(super) fn require(dir: &Path, files: impl IntoIterator<Item = impl AsRef<str>>) -> Result<(), LayoutError> {
    match files.into_iter().find(|f| !dir.join(f.as_ref()).is_file()) {
        Some(file) => Err(LayoutError::Missing {
            dir: dir.display().to_string(),
            file: file.as_ref().to_owned(),
        }),
        None => Ok(()),
    }
}

/// Pixels per latent along each axis: 2^(VAE blocks − 1), from `vae_decoder/config.json`.
pub(super) fn vae_scale(vae: &serde_json::Value) -> usize {
    let blocks = vae["block_out_channels"].as_array().map_or(4, |b| b.len());
    1usize << blocks.clamp(1, 8).saturating_sub(1)
}
