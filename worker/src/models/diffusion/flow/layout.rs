//! A FLUX.1 or Stable Diffusion 3 directory in the Optimum ONNX layout (what `optimum-cli export
//! onnx` writes for `FluxPipeline` / `StableDiffusion3Pipeline`), read without loading a session:
//!
//! ```text
//! model_index.json                       _class_name FluxPipeline / StableDiffusion3Pipeline
//! scheduler/scheduler_config.json        FlowMatchEulerDiscreteScheduler
//! tokenizer/                             CLIP-L (vocab.json, merges.txt, tokenizer_config.json)
//! text_encoder/model.onnx                CLIP-L (FLUX: its pooled output; SD3: with projection)
//! tokenizer_2/, text_encoder_2/          FLUX: T5 (tokenizer.json); SD3: CLIP-G
//! tokenizer_3/, text_encoder_3/          SD3: T5
//! transformer/{model.onnx, config.json}
//! vae_decoder/{model.onnx, config.json}  16 latent channels, scaling_factor and shift_factor
//! ```

use std::path::{Path, PathBuf};

use crate::models::diffusion::layout::{self, LayoutError};
use crate::models::diffusion::schedulers::SchedulerConfig;
use crate::models::diffusion::schedulers::flow_euler::{FlowSchedule, FlowSigmas};
use crate::models::diffusion::tokenizer::{ClipTokenizer, T5Tokenizer};

/// The longest T5 window: FluxPipeline and StableDiffusion3Pipeline refuse more than 512.
pub const MAX_T5_LENGTH: usize = 512;

/// Which flow-matching pipeline a directory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlowFamily {
    /// FLUX.1 (schnell, dev): CLIP pooled + T5, packed 2×2 latents, no classifier-free guidance;
    /// dev takes the guidance scale as an embedding.
    Flux,
    /// Stable Diffusion 3 / 3.5: CLIP-L + CLIP-G + T5, classifier-free guidance.
    Sd3,
}

impl FlowFamily {
    /// The family of the directory, if it holds a flow transformer: its `model_index.json`'s
    /// (`index`, [`layout::model_index`]) class, else the directories present.
    pub fn detect(dir: &Path, index: &serde_json::Value) -> Option<FlowFamily> {
        let class = index["_class_name"].as_str().unwrap_or("");
        // Exactly these pipelines: FLUX Kontext, Fill or FLUX.2 share the prefix but not the
        // inputs, and are not served as text-to-image.
        match class {
            "FluxPipeline" => return Some(FlowFamily::Flux),
            "StableDiffusion3Pipeline" => return Some(FlowFamily::Sd3),
            _ => {}
        }
        if !class.is_empty() || !dir.join("transformer").is_dir() {
            return None;
        }
        Some(if dir.join("text_encoder_3").is_dir() {
            FlowFamily::Sd3
        } else {
            FlowFamily::Flux
        })
    }

    /// The pipelines' default T5 window (`max_sequence_length`).
    pub fn default_t5_length(self) -> usize {
        match self {
            FlowFamily::Flux => 512,
            FlowFamily::Sd3 => 256,
        }
    }

    /// The directory of the T5 tokenizer and encoder (`tokenizer_N`, `text_encoder_N`).
    pub fn t5_suffix(self) -> &'static str {
        match self {
            FlowFamily::Flux => "_2",
            FlowFamily::Sd3 => "_3",
        }
    }

    /// The sigmas the family's pipeline gives its scheduler.
    pub fn sigmas(self) -> FlowSigmas {
        match self {
            FlowFamily::Flux => FlowSigmas::Linear,
            FlowFamily::Sd3 => FlowSigmas::Scheduler,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FlowFamily::Flux => "FLUX.1",
            FlowFamily::Sd3 => "SD3",
        }
    }
}

/// What the CPU side of a flow pipeline needs from its directory.
pub struct FlowLayout {
    pub dir: PathBuf,
    pub family: FlowFamily,
    /// CLIP-L's tokenizer (`tokenizer/`).
    pub clip: ClipTokenizer,
    /// SD3's CLIP-G tokenizer (`tokenizer_2/`, pads with `!`).
    pub clip_2: Option<ClipTokenizer>,
    pub t5: T5Tokenizer,
    /// T5's window: the pipeline's default unless the catalog sets it.
    pub t5_length: usize,
    pub scheduler: SchedulerConfig,
    /// The VAE's `scaling_factor` and `shift_factor`: it decodes `latents / scaling + shift`.
    pub scaling_factor: f32,
    pub shift_factor: f32,
    /// Pixels per latent (8).
    pub vae_scale: usize,
    /// 16.
    pub latent_channels: usize,
    /// Latents per transformer token along each side (2: FLUX packs 2×2, SD3 patches 2×2).
    pub patch: usize,
    /// FLUX.1-dev's `guidance_embeds`: the guidance scale goes in as the `guidance` input.
    pub guidance_embeds: bool,
    /// SD3's `pos_embed_max_size`: patches per side its positional embedding covers (192 for
    /// SD3.5, 3072 pixels); FLUX's rotary positions have no such bound.
    pub max_patches: Option<usize>,
}

impl FlowLayout {
    /// Reads `dir`, a directory of `family`; `t5_length` overrides the pipeline's T5 window.
    pub fn open(dir: &Path, family: FlowFamily, t5_length: Option<usize>) -> Result<FlowLayout, LayoutError> {
        let t5 = family.t5_suffix();
        let mut required = vec![
            "scheduler/scheduler_config.json".to_owned(),
            "tokenizer/vocab.json".into(),
            "tokenizer/merges.txt".into(),
            "tokenizer/tokenizer_config.json".into(),
            "text_encoder/model.onnx".into(),
            "text_encoder_2/model.onnx".into(),
            "transformer/model.onnx".into(),
            "transformer/config.json".into(),
            "vae_decoder/model.onnx".into(),
            "vae_decoder/config.json".into(),
            format!("tokenizer{t5}/tokenizer.json"),
        ];
        if family == FlowFamily::Sd3 {
            required.extend([
                "text_encoder_3/model.onnx".into(),
                "tokenizer_2/vocab.json".into(),
                "tokenizer_2/merges.txt".into(),
                "tokenizer_2/tokenizer_config.json".into(),
            ]);
        }
        layout::require(dir, &required)?;
        let json = |file: &str| layout::config(dir, file);
        let config_error = |file: &str, reason: String| LayoutError::Config {
            file: dir.join(file).display().to_string(),
            reason,
        };
        let scheduler = layout::scheduler_config(dir)?;
        // A config flow_euler cannot run as diffusers would is refused here, not per request.
        FlowSchedule::new(&scheduler, 1, family.sigmas(), 1)?;
        let vae = json("vae_decoder/config.json")?;
        let transformer = json("transformer/config.json")?;
        let latent_channels = vae["latent_channels"].as_u64().unwrap_or(16) as usize;
        let patch = match family {
            FlowFamily::Flux => 2,
            FlowFamily::Sd3 => transformer["patch_size"].as_u64().unwrap_or(2) as usize,
        };
        if family == FlowFamily::Flux {
            let in_channels = transformer["in_channels"].as_u64().unwrap_or(64) as usize;
            if in_channels != latent_channels * 4 {
                return Err(config_error(
                    "transformer/config.json",
                    format!(
                        "in_channels {in_channels}: FLUX packs 2x2 latents of {latent_channels} channels ({})",
                        latent_channels * 4
                    ),
                ));
            }
        }
        let t5_length = t5_length.unwrap_or(family.default_t5_length());
        if !(2..=MAX_T5_LENGTH).contains(&t5_length) {
            return Err(LayoutError::Setting(format!(
                "t5_max_length {t5_length} is not in 2..={MAX_T5_LENGTH} (both pipelines refuse more)"
            )));
        }
        let scaling_factor = vae["scaling_factor"]
            .as_f64()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| config_error("vae_decoder/config.json", "`scaling_factor` must be a positive number".into()))?;
        let shift_factor = vae["shift_factor"].as_f64().unwrap_or(0.0);
        if !shift_factor.is_finite() || latent_channels == 0 || patch == 0 {
            return Err(config_error(
                "vae_decoder/config.json",
                "`shift_factor` must be finite, `latent_channels` and the transformer's `patch_size` positive".into(),
            ));
        }
        Ok(FlowLayout {
            dir: dir.to_owned(),
            family,
            clip: ClipTokenizer::load(&dir.join("tokenizer"))?,
            clip_2: match family {
                FlowFamily::Flux => None,
                FlowFamily::Sd3 => Some(ClipTokenizer::load(&dir.join("tokenizer_2"))?),
            },
            t5: T5Tokenizer::load(&dir.join(format!("tokenizer{t5}")))?,
            t5_length,
            scheduler,
            scaling_factor: scaling_factor as f32,
            shift_factor: shift_factor as f32,
            vae_scale: layout::vae_scale(&vae),
            latent_channels,
            patch,
            guidance_embeds: family == FlowFamily::Flux && transformer["guidance_embeds"].as_bool().unwrap_or(false),
            max_patches: match family {
                FlowFamily::Flux => None,
                FlowFamily::Sd3 => transformer["pos_embed_max_size"].as_u64().map(|m| m as usize),
            },
        })
    }

    /// What a width or height must be a multiple of: the VAE's scale × the patch (16).
    pub fn size_multiple(&self) -> usize {
        self.vae_scale * self.patch
    }

    /// Transformer tokens of an image (the scheduler's image sequence length).
    pub fn image_seq_len(&self, width: usize, height: usize) -> usize {
        let side = self.size_multiple();
        (width / side) * (height / side)
    }
}
