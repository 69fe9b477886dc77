//! The model catalog: which models a deployment serves, where their files are, and each one's
//! bounds and defaults. One file (`SLUICE_MODEL_CATALOG`, TOML) read by the producer, which
//! validates requests against it and writes fully explicit records, and by the worker, which
//! loads what it lists.
//!
//! ```toml
//! [[model]]
//! name = "terrain"
//! kind = "terrain"
//!
//! [[model]]
//! name = "sd15"
//! kind = "diffusion"
//! path = "sd15-onnx"            # relative to SLUICE_MODEL_DIR, or absolute; default: the name
//! width = { min = 256, max = 768, default = 512 }
//! height = { min = 256, max = 768, default = 512 }
//! size_multiple = 64           # VAE factor × UNet down-sampling (default 64)
//! steps = { min = 1, max = 50, default = 25 }
//! guidance_scale = { min = 0.0, max = 20.0, default = 7.5 }
//! samplers = ["euler", "euler_a", "ddim", "dpmpp_2m", "dpmpp_2m_karras"]
//! default_sampler = "dpmpp_2m_karras"
//! max_num_images = 4
//! max_prompt_chars = 1000
//! max_ttl_seconds = 86400  # the furthest deadline a task may ask for (default 30 days)
//! max_task_pixels = 2097152  # width × height × num_images of one task (default: the kind's)
//! max_task_rows = 8          # model rows of one task (terrain: tiles; SD: images)
//! modes = ["text", "img2img", "inpaint"]  # what a task may start from (an inpainting model: ["inpaint"])
//!
//! [[model]]
//! name = "flux-schnell"
//! kind = "diffusion"    # the family (SD, SDXL, FLUX.1, SD3) is read from model_index.json
//! size_multiple = 16
//! samplers = ["flow_euler"]    # FLUX.1 and SD3 run flow_euler alone
//! default_sampler = "flow_euler"
//! modes = ["text"]
//! negative_prompt = false      # FLUX.1 takes none (a request with one is a 400)
//! text_encoders = "cpu"        # FLUX/SD3: "device" (default), "cpu" or "on_demand"
//! t5_max_length = 256          # FLUX/SD3: T5's window (default: the pipeline's, 512 / 256)
//! ```
//!
//! Without a file the catalog is the built-in terrain model alone, as before catalogs existed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::normalize::{MAX_SEED, terrain};
use crate::{Generation, Sampler, TaskRequest, Violation};

/// What kind of pipeline runs a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The pretrained terrain model.
    Terrain,
    /// A diffusion model from an Optimum ONNX export, its family read from `model_index.json`:
    /// Stable Diffusion 1.x/2.x, SDXL, FLUX.1 or SD3. `stable-diffusion`, its name before FLUX.1
    /// and SD3 joined, is still read.
    #[serde(alias = "stable-diffusion")]
    Diffusion,
}

impl ModelKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Terrain => "terrain",
            ModelKind::Diffusion => "diffusion",
        }
    }
}

/// What a task starts from: noise (`text`), an init image (`img2img`), or an init image and a
/// mask (`inpaint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskMode {
    Text,
    Img2img,
    Inpaint,
}

impl TaskMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskMode::Text => "text",
            TaskMode::Img2img => "img2img",
            TaskMode::Inpaint => "inpaint",
        }
    }

    /// The mode a request asks for, from the images it sends.
    pub fn of(init_image: bool, mask_image: bool) -> TaskMode {
        match (init_image, mask_image) {
            (false, _) => TaskMode::Text,
            (true, false) => TaskMode::Img2img,
            (true, true) => TaskMode::Inpaint,
        }
    }
}

fn sd_modes() -> Vec<TaskMode> {
    vec![TaskMode::Text, TaskMode::Img2img, TaskMode::Inpaint]
}

/// An inclusive range with a default inside it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bounded<T> {
    pub min: T,
    pub max: T,
    pub default: T,
}

/// Where a flow transformer's text encoders live (FLUX's T5-XXL is 4.7 B parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextEncoders {
    /// On the worker's device, beside the transformer.
    Device,
    /// On the CPU: no device memory.
    Cpu,
    /// On the worker's device, loaded for each batch's encoding and released after it.
    OnDemand,
}

fn sd_width() -> Bounded<u32> {
    Bounded {
        min: 64,
        max: 1024,
        default: 512,
    }
}
fn sd_steps() -> Bounded<u32> {
    Bounded {
        min: 1,
        max: 50,
        default: 25,
    }
}
fn sd_guidance() -> Bounded<f64> {
    Bounded {
        min: 0.0,
        max: 20.0,
        default: 7.5,
    }
}
/// An entry's default samplers: every one the UNet families run.
fn sd_samplers() -> Vec<String> {
    Sampler::ALL
        .into_iter()
        .filter(|s| !s.for_flow_models())
        .map(|s| s.name().to_owned())
        .collect()
}
fn sd_default_sampler() -> String {
    "euler".into()
}
fn sixty_four() -> u32 {
    64
}
fn four() -> u32 {
    4
}
fn prompt_chars() -> usize {
    2000
}
fn yes() -> bool {
    true
}

/// The longest deadline a task of the model may ask for: 30 days.
pub const DEFAULT_MAX_TTL_SECONDS: u64 = 30 * 86_400;

fn max_ttl() -> u64 {
    DEFAULT_MAX_TTL_SECONDS
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogModel {
    pub name: String,
    pub kind: ModelKind,
    /// Directory of the model's files, relative to the model directory or absolute; the name
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default = "sd_width")]
    pub width: Bounded<u32>,
    #[serde(default = "sd_width")]
    pub height: Bounded<u32>,
    #[serde(default = "sixty_four")]
    pub size_multiple: u32,
    #[serde(default = "sd_steps")]
    pub steps: Bounded<u32>,
    #[serde(default = "sd_guidance")]
    pub guidance_scale: Bounded<f64>,
    #[serde(default = "sd_samplers")]
    pub samplers: Vec<String>,
    #[serde(default = "sd_default_sampler")]
    pub default_sampler: String,
    #[serde(default = "four")]
    pub max_num_images: u32,
    #[serde(default = "prompt_chars")]
    pub max_prompt_chars: usize,
    /// The furthest `deadline` (or largest `ttl_seconds`) a task may ask for, seconds.
    #[serde(default = "max_ttl")]
    pub max_ttl_seconds: u64,
    /// The most pixels one task may ask for, `width × height × num_images` (default: the
    /// kind's, [`CatalogModel::max_task_pixels`]).
    #[serde(default, rename = "max_task_pixels", skip_serializing_if = "Option::is_none")]
    pub task_pixels: Option<u64>,
    /// The most model rows one task may ask for (terrain: 128×128 tiles of every image; Stable
    /// Diffusion: images); default: the kind's, [`CatalogModel::max_task_rows`].
    #[serde(default, rename = "max_task_rows", skip_serializing_if = "Option::is_none")]
    pub task_rows: Option<u64>,
    /// What its tasks may start from (default: all three for Stable Diffusion; an inpainting
    /// model, whose UNet takes 9 channels, is `["inpaint"]`; the export needs `vae_encoder/`
    /// for the image modes).
    #[serde(default = "sd_modes")]
    pub modes: Vec<TaskMode>,
    /// Whether the model takes a negative prompt (FLUX.1 does not; default true).
    #[serde(default = "yes")]
    pub negative_prompt: bool,
    /// FLUX.1 / SD3: where the text encoders' sessions live (default: the device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoders: Option<TextEncoders>,
    /// FLUX.1 / SD3: T5's sequence length (default: the pipeline's, 512 for FLUX, 256 for SD3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t5_max_length: Option<u32>,
    /// Diffusion: every how many steps a running task's state (latents, sampler state) is written
    /// to object storage, so that a task whose worker dies carries on from there (absent: never;
    /// for models whose tasks are short).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u32>,
    /// Diffusion: a running task's state is also written once this many seconds have gone by
    /// since it was last written (or its run began), whatever the steps (absent: by steps only).
    /// For a model whose steps take seconds each, or vary with the image size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_seconds: Option<u32>,
}

/// Default bounds of one task's work, by kind: two full-size terrain maps (2 × 2048²) in at
/// most 1,024 tiles; two megapixels (four 512² images, two 1024²) of Stable Diffusion.
const TERRAIN_TASK_PIXELS: u64 = 2 * 2048 * 2048;
const TERRAIN_TASK_ROWS: u64 = 1024;
const SD_TASK_PIXELS: u64 = 2 * 1024 * 1024;
const SD_TASK_ROWS: u64 = 8;

impl CatalogModel {
    /// The built-in terrain model, with the bounds its own rules impose.
    pub fn terrain(name: &str) -> CatalogModel {
        CatalogModel {
            name: name.to_owned(),
            kind: ModelKind::Terrain,
            path: None,
            width: Bounded {
                min: 16,
                max: 2048,
                default: terrain::NATIVE_SIZE,
            },
            height: Bounded {
                min: 16,
                max: 2048,
                default: terrain::NATIVE_SIZE,
            },
            size_multiple: 1,
            steps: Bounded {
                min: 1,
                max: 1,
                default: 1,
            },
            guidance_scale: Bounded {
                min: 1.0,
                max: 1.0,
                default: 1.0,
            },
            samplers: vec!["onestep".into()],
            default_sampler: "onestep".into(),
            max_num_images: 8,
            max_prompt_chars: 2000,
            max_ttl_seconds: DEFAULT_MAX_TTL_SECONDS,
            task_pixels: None,
            task_rows: None,
            modes: vec![TaskMode::Text],
            negative_prompt: false,
            text_encoders: None,
            t5_max_length: None,
            checkpoint_every: None,
            checkpoint_every_seconds: None,
        }
    }

    /// The most pixels (`width × height × num_images`) one task may ask for.
    pub fn max_task_pixels(&self) -> u64 {
        self.task_pixels.unwrap_or(match self.kind {
            ModelKind::Terrain => TERRAIN_TASK_PIXELS,
            ModelKind::Diffusion => SD_TASK_PIXELS,
        })
    }

    /// The most model rows one task may ask for.
    pub fn max_task_rows(&self) -> u64 {
        self.task_rows.unwrap_or(match self.kind {
            ModelKind::Terrain => TERRAIN_TASK_ROWS,
            ModelKind::Diffusion => SD_TASK_ROWS,
        })
    }

    /// Model rows of a task: what it asks of one model call, and of memory.
    pub fn task_rows(&self, g: &Generation) -> Result<u64, String> {
        Ok(match self.kind {
            ModelKind::Terrain => {
                let params = terrain::Params::from_map(&g.params)?;
                terrain::rows(g.width, g.height, g.num_images, params.tile_overlap)
            }
            ModelKind::Diffusion => u64::from(g.num_images),
        })
    }

    /// Checks the work a task asks of this model against its bounds: steps, pixels
    /// (`width × height × num_images`) and model rows. Each violation names every request
    /// field it comes from. The producer refuses such requests; the worker dead-letters such
    /// records (they can reach the topic without the producer).
    pub fn check_work(&self, g: &Generation) -> Vec<Violation> {
        let mut v = Vec::new();
        if g.steps < self.steps.min || g.steps > self.steps.max {
            v.push(violation(
                "steps",
                format!(
                    "must be {} to {} for model {}, got {}",
                    self.steps.min, self.steps.max, self.name, g.steps
                ),
            ));
        }
        let name_all = |v: &mut Vec<Violation>, fields: &[&str], message: String| {
            v.extend(fields.iter().map(|f| violation(f, message.clone())));
        };
        let pixels = u64::from(g.width) * u64::from(g.height) * u64::from(g.num_images);
        if pixels > self.max_task_pixels() {
            name_all(
                &mut v,
                &["width", "height", "num_images"],
                format!(
                    "width × height × num_images is {pixels} pixels; model {} takes at most {} (max_task_pixels)",
                    self.name,
                    self.max_task_pixels()
                ),
            );
        }
        match self.task_rows(g) {
            Err(e) => v.push(violation("params", e)),
            Ok(rows) if rows > self.max_task_rows() => {
                let (fields, what): (&[&str], _) = match self.kind {
                    ModelKind::Terrain => (
                        &["width", "height", "num_images", "params.tile_overlap"],
                        "128×128 tiles of every image",
                    ),
                    ModelKind::Diffusion => (&["num_images"], "images"),
                };
                name_all(
                    &mut v,
                    fields,
                    format!(
                        "the task is {rows} model rows ({what}); model {} takes at most {} (max_task_rows)",
                        self.name,
                        self.max_task_rows()
                    ),
                );
            }
            Ok(_) => {}
        }
        v
    }

    /// The model's directory.
    pub fn dir(&self, model_dir: &Path) -> PathBuf {
        model_dir.join(self.path.as_deref().unwrap_or(&self.name))
    }

    fn check(&self) -> Result<(), String> {
        let bad = |what: String| Err(format!("model {:?}: {what}", self.name));
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
            return bad("the name must be letters, digits, '.', '_' or '-'".into());
        }
        if self.modes.is_empty() {
            return bad("modes must name at least one of text, img2img, inpaint".into());
        }
        if !(1..=DEFAULT_MAX_TTL_SECONDS).contains(&self.max_ttl_seconds) {
            return bad(format!("max_ttl_seconds must be 1 to {DEFAULT_MAX_TTL_SECONDS} (30 days)"));
        }
        for (what, b) in [("width", self.width), ("height", self.height), ("steps", self.steps)] {
            if !(b.min <= b.default && b.default <= b.max) || b.min == 0 {
                return bad(format!("{what}: need 0 < min <= default <= max, got {b:?}"));
            }
        }
        let g = self.guidance_scale;
        if !(g.min <= g.default && g.default <= g.max) {
            return bad(format!("guidance_scale: need min <= default <= max, got {g:?}"));
        }
        if self.checkpoint_every == Some(0) {
            return bad("checkpoint_every must be at least 1 (leave it out for no checkpoints)".into());
        }
        if let Some(s) = self.checkpoint_every_seconds.filter(|s| !(1..=86_400).contains(s)) {
            return bad(format!(
                "checkpoint_every_seconds must be 1 to 86400, not {s} (leave it out for steps only)"
            ));
        }
        if self.kind == ModelKind::Diffusion {
            if let Some(s) = self.samplers.iter().find(|s| Sampler::parse(s).is_none()) {
                return bad(format!("sampler {s:?} is not one of {}", Sampler::names()));
            }
            if self.t5_max_length.is_some_and(|l| !(2..=512).contains(&l)) {
                return bad(format!(
                    "t5_max_length must be in 2..=512 (FLUX's and SD3's pipelines refuse more), got {:?}",
                    self.t5_max_length
                ));
            }
            if self.size_multiple == 0 || !self.size_multiple.is_multiple_of(8) {
                return bad(format!(
                    "size_multiple must be a multiple of 8 (the VAE's factor), got {}",
                    self.size_multiple
                ));
            }
        }
        if !self.samplers.contains(&self.default_sampler) {
            return bad(format!("default_sampler {:?} is not among samplers", self.default_sampler));
        }
        if self.max_num_images == 0 {
            return bad("max_num_images must be at least 1".into());
        }
        let default_pixels = u64::from(self.width.default) * u64::from(self.height.default);
        if self.max_task_pixels() < default_pixels {
            return bad(format!(
                "max_task_pixels {} is below one image at the default size ({default_pixels})",
                self.max_task_pixels()
            ));
        }
        if self.max_task_rows() == 0 {
            return bad("max_task_rows must be at least 1".into());
        }
        Ok(())
    }
}

/// The catalog file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalog {
    #[serde(rename = "model")]
    pub models: Vec<CatalogModel>,
}

#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("model catalog {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("model catalog: {0}")]
    Invalid(String),
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog {
            models: vec![CatalogModel::terrain(terrain::NAME)],
        }
    }
}

impl Catalog {
    /// Reads `path`, or the built-in catalog when there is none.
    pub fn load(path: Option<&Path>) -> Result<Catalog, CatalogError> {
        let Some(path) = path else { return Ok(Catalog::default()) };
        let read = |reason: String| CatalogError::Read {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| read(e.to_string()))?;
        Catalog::parse(&text).map_err(|e| match e {
            CatalogError::Invalid(reason) => read(reason),
            e => e,
        })
    }

    pub fn parse(text: &str) -> Result<Catalog, CatalogError> {
        let mut catalog: Catalog = toml::from_str(text).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        for m in &mut catalog.models {
            if m.kind == ModelKind::Terrain {
                // Terrain's sizes are its own; a path, the deadline bound and the bounds of a
                // task's work are all a catalog sets.
                let (path, max_ttl_seconds, task_pixels, task_rows) = (m.path.take(), m.max_ttl_seconds, m.task_pixels, m.task_rows);
                *m = CatalogModel {
                    path,
                    max_ttl_seconds,
                    task_pixels,
                    task_rows,
                    ..CatalogModel::terrain(&m.name)
                };
            }
            m.check().map_err(CatalogError::Invalid)?;
        }
        let mut names: Vec<&str> = catalog.models.iter().map(|m| m.name.as_str()).collect();
        names.sort();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(CatalogError::Invalid(format!("model {:?} is listed twice", w[0])));
        }
        if catalog.models.is_empty() {
            return Err(CatalogError::Invalid("lists no model".into()));
        }
        Ok(catalog)
    }

    pub fn get(&self, name: &str) -> Option<&CatalogModel> {
        self.models.iter().find(|m| m.name == name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.models.iter().map(|m| m.name.as_str()).collect()
    }

    /// The furthest deadline any model allows (`max_ttl_seconds`): the longest a task may wait.
    pub fn longest_ttl_seconds(&self) -> u64 {
        self.models.iter().map(|m| m.max_ttl_seconds).max().unwrap_or(0)
    }

    /// Checks a request (already valid against `task-request.schema.json`) against its model's
    /// entry and fills every default; `seed` is called only when the request has none. Every
    /// violation names its field.
    pub fn normalize(&self, request: TaskRequest, seed: impl FnOnce() -> u64) -> Result<(String, Generation), Vec<Violation>> {
        let Some(model) = self.get(&request.model) else {
            return Err(vec![violation(
                "model",
                format!(
                    "unknown model {:?}; this deployment serves: {}",
                    request.model,
                    self.names().join(", ")
                ),
            )]);
        };
        if model.kind == ModelKind::Terrain {
            let (_, generation) = crate::normalize::normalize_terrain(request, seed).map_err(|e| vec![violation("params", e)])?;
            let v = model.check_work(&generation);
            return if v.is_empty() {
                Ok((model.name.clone(), generation))
            } else {
                Err(v)
            };
        }
        let mut v = Vec::new();
        let width = request.width.unwrap_or(model.width.default);
        let height = request.height.unwrap_or(model.height.default);
        for (field, value, b) in [("width", width, model.width), ("height", height, model.height)] {
            if value < b.min || value > b.max {
                v.push(violation(
                    field,
                    format!("must be {} to {} for model {}, got {value}", b.min, b.max, model.name),
                ));
            } else if !value.is_multiple_of(model.size_multiple) {
                v.push(violation(
                    field,
                    format!("must be a multiple of {}, got {value}", model.size_multiple),
                ));
            }
        }
        let steps = request.steps.unwrap_or(model.steps.default);
        if steps < model.steps.min || steps > model.steps.max {
            v.push(violation(
                "steps",
                format!(
                    "must be {} to {} for model {}, got {steps}",
                    model.steps.min, model.steps.max, model.name
                ),
            ));
        }
        let guidance = request.guidance_scale.unwrap_or(model.guidance_scale.default);
        let g = model.guidance_scale;
        if guidance < g.min || guidance > g.max {
            v.push(violation(
                "guidance_scale",
                format!("must be {} to {} for model {}, got {guidance}", g.min, g.max, model.name),
            ));
        }
        let sampler = request.sampler.unwrap_or_else(|| model.default_sampler.clone());
        if !model.samplers.contains(&sampler) {
            v.push(violation(
                "sampler",
                format!(
                    "must be one of {} for model {}, got {sampler:?}",
                    model.samplers.join(", "),
                    model.name
                ),
            ));
        }
        let rules = Sampler::parse(&sampler);
        if let Some(max) = rules.and_then(Sampler::max_steps).filter(|max| steps > *max) {
            v.push(violation(
                "steps",
                format!("the {sampler} sampler takes 1 to {max} steps, got {steps}"),
            ));
        }
        let num_images = request.num_images.unwrap_or(1);
        if num_images > model.max_num_images {
            v.push(violation(
                "num_images",
                format!("at most {} for model {}, got {num_images}", model.max_num_images, model.name),
            ));
        }
        let prompt = request.prompt.unwrap_or_default();
        if prompt.trim().is_empty() {
            v.push(violation("prompt", format!("is required for model {}", model.name)));
        }
        let negative_prompt = request.negative_prompt;
        if negative_prompt.is_some() && !model.negative_prompt {
            v.push(violation(
                "negative_prompt",
                format!(
                    "model {} takes no negative prompt (it runs without classifier-free guidance)",
                    model.name
                ),
            ));
        }
        for (field, text) in [
            ("prompt", prompt.as_str()),
            ("negative_prompt", negative_prompt.as_deref().unwrap_or("")),
        ] {
            let n = text.chars().count();
            if n > model.max_prompt_chars {
                v.push(violation(
                    field,
                    format!("at most {} characters for model {}, got {n}", model.max_prompt_chars, model.name),
                ));
            }
        }
        if request.params.as_ref().is_some_and(|p| !p.is_empty()) {
            v.push(violation("params", format!("model {} takes no params", model.name)));
        }
        // img2img and inpainting: diffusers' default strengths; at least one step must run.
        let strength = match (&request.init_image, &request.mask_image) {
            (None, _) => None,
            (Some(_), mask) => Some(request.strength.unwrap_or(if mask.is_some() { 1.0 } else { 0.8 })),
        };
        let mode = TaskMode::of(request.init_image.is_some(), request.mask_image.is_some());
        if !model.modes.contains(&mode) {
            // The field that is missing or too much.
            let images = model.modes.iter().any(|m| *m != TaskMode::Text);
            let field = if mode != TaskMode::Text && images {
                "mask_image"
            } else {
                "init_image"
            };
            let modes: Vec<&str> = model.modes.iter().map(|m| m.as_str()).collect();
            v.push(violation(
                field,
                format!("model {} takes {} tasks, not {}", model.name, modes.join(", "), mode.as_str()),
            ));
        }
        if strength.is_some() && rules.is_some_and(|s| !s.takes_init_image()) {
            v.push(violation(
                "sampler",
                format!("the {sampler} sampler takes no init_image (img2img and inpainting run the other samplers)"),
            ));
        }
        if let Some(s) = strength.filter(|s| (f64::from(steps) * s) < 1.0) {
            v.push(violation(
                "strength",
                format!("{s} of {steps} steps runs no step (int(steps x strength) must be at least 1)"),
            ));
        }
        if !v.is_empty() {
            return Err(v);
        }
        let generation = Generation {
            prompt,
            negative_prompt,
            steps,
            guidance_scale: guidance,
            seed: request.seed.unwrap_or_else(|| seed().min(MAX_SEED)),
            sampler,
            width,
            height,
            num_images,
            params: Default::default(),
            // The images are stored, and their references set, by the producer.
            init_image: None,
            mask_image: None,
            strength,
        };
        let v = model.check_work(&generation);
        if !v.is_empty() {
            return Err(v);
        }
        Ok((model.name.clone(), generation))
    }
}

fn violation(field: &str, message: String) -> Violation {
    Violation {
        field: field.to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SD: &str = r#"
[[model]]
name = "terrain"
kind = "terrain"

[[model]]
name = "sd-tiny"
kind = "stable-diffusion"
width = { min = 64, max = 256, default = 64 }
height = { min = 64, max = 256, default = 64 }
steps = { min = 1, max = 20, default = 4 }
"#;

    /// `diffusion` names what the kind covers (SD, SDXL, FLUX.1, SD3); catalogs written with its
    /// old name, `stable-diffusion`, still load, and both are reported as `diffusion`.
    #[test]
    fn the_diffusion_kind_is_read_under_both_names() {
        let old = Catalog::parse(SD).unwrap();
        let new = Catalog::parse(&SD.replace("stable-diffusion", "diffusion")).unwrap();
        for c in [old, new] {
            let m = c.get("sd-tiny").unwrap();
            assert_eq!((m.kind, m.kind.as_str()), (ModelKind::Diffusion, "diffusion"));
        }
        assert!(Catalog::parse(&SD.replace("stable-diffusion", "flux")).is_err());
    }

    fn request(json: serde_json::Value) -> TaskRequest {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn defaults_fill_a_minimal_request() {
        let c = Catalog::parse(SD).unwrap();
        let (name, g) = c
            .normalize(request(serde_json::json!({"model": "sd-tiny", "prompt": "a cat"})), || 5)
            .unwrap();
        assert_eq!(name, "sd-tiny");
        assert_eq!(
            (g.width, g.height, g.steps, g.sampler.as_str(), g.guidance_scale, g.seed),
            (64, 64, 4, "euler", 7.5, 5)
        );
    }

    #[test]
    fn each_bound_is_a_violation_naming_its_field() {
        let c = Catalog::parse(SD).unwrap();
        let e = c
            .normalize(
                request(
                    serde_json::json!({"model": "sd-tiny", "prompt": "", "width": 72 + 3, "height": 512, "steps": 30,
                    "sampler": "onestep", "num_images": 5, "guidance_scale": 25.0}),
                ),
                || 0,
            )
            .unwrap_err();
        let fields: Vec<&str> = e.iter().map(|v| v.field.as_str()).collect();
        for f in ["width", "height", "steps", "sampler", "num_images", "guidance_scale", "prompt"] {
            assert!(fields.contains(&f), "{f} in {e:?}");
        }
        let e = c
            .normalize(request(serde_json::json!({"model": "sd-xl", "prompt": "x"})), || 0)
            .unwrap_err();
        assert_eq!(e[0].field, "model");
        assert!(e[0].message.contains("terrain, sd-tiny"), "{}", e[0].message);
    }

    /// The request of issue 19 (~29,800 tiles in one call) and its kin are refused by the
    /// catalog, naming every field that adds to the work; a catalog can move the bounds.
    #[test]
    fn one_task_s_work_is_bounded_and_the_fields_are_named() {
        let c = Catalog::parse(SD).unwrap();
        let hostile = serde_json::json!({"model": "terrain", "width": 2048, "height": 2048, "num_images": 8,
            "params": {"tile_overlap": 96}});
        let e = c.normalize(request(hostile), || 0).unwrap_err();
        let fields: Vec<&str> = e.iter().map(|v| v.field.as_str()).collect();
        for f in ["width", "height", "num_images", "params.tile_overlap"] {
            assert!(fields.contains(&f), "{f} in {e:?}");
        }
        assert!(
            e.iter()
                .any(|v| v.message.contains("29768 model rows") && v.message.contains("max_task_rows")),
            "{e:?}"
        );
        assert!(e.iter().any(|v| v.message.contains("max_task_pixels")), "{e:?}");
        // Within the bounds: one full-size map, two at the default overlap.
        for ok in [
            serde_json::json!({"model": "terrain", "width": 2048, "height": 2048}),
            serde_json::json!({"model": "terrain", "width": 2048, "height": 2048, "num_images": 2}),
        ] {
            c.normalize(request(ok), || 0).unwrap();
        }
        // Rows alone: one 2048² map at overlap 96 is 3,721 tiles.
        let e = c
            .normalize(
                request(serde_json::json!({"model": "terrain", "width": 2048, "height": 2048, "params": {"tile_overlap": 96}})),
                || 0,
            )
            .unwrap_err();
        assert!(e.iter().all(|v| v.message.contains("max_task_rows")), "{e:?}");
        // Stable Diffusion: pixels × images, set by the catalog.
        let small = Catalog::parse(&format!("{SD}max_task_pixels = 65536\n")).unwrap();
        let sd = |n: u32| request(serde_json::json!({"model": "sd-tiny", "prompt": "x", "width": 256, "height": 256, "num_images": n}));
        small.normalize(sd(1), || 0).unwrap();
        let e = small.normalize(sd(2), || 0).unwrap_err();
        assert_eq!(
            e.iter().map(|v| v.field.as_str()).collect::<Vec<_>>(),
            ["width", "height", "num_images"]
        );
        // The worker's check of a record: steps out of the model's range.
        let (_, mut g) = c
            .normalize(request(serde_json::json!({"model": "sd-tiny", "prompt": "x"})), || 0)
            .unwrap();
        g.steps = 150;
        assert_eq!(c.get("sd-tiny").unwrap().check_work(&g)[0].field, "steps");
        assert!(
            Catalog::parse(&format!("{SD}max_task_pixels = 100\n")).is_err(),
            "below one default image"
        );
    }

    #[test]
    fn a_bad_catalog_is_refused_with_the_reason() {
        for (text, want) in [
            ("[[model]]\nname = \"a\"\nkind = \"unet\"", "unknown variant"),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\nsamplers = [\"plms\"]",
                "plms",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"terrain\"\n[[model]]\nname = \"a\"\nkind = \"terrain\"",
                "twice",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\nsteps = { min = 5, max = 4, default = 4 }",
                "steps",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\nt5_max_length = 1024",
                "t5_max_length",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\ntext_encoders = \"gpu\"",
                "unknown variant",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\ncheckpoint_every = 0",
                "checkpoint_every",
            ),
            (
                "[[model]]\nname = \"a\"\nkind = \"stable-diffusion\"\ncheckpoint_every_seconds = 0",
                "checkpoint_every_seconds must be 1 to 86400",
            ),
        ] {
            let e = Catalog::parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert_eq!(Catalog::load(None).unwrap().names(), vec!["terrain"]);
        let every = Catalog::parse("[[model]]\nname = \"a\"\nkind = \"diffusion\"\ncheckpoint_every = 5").unwrap();
        assert_eq!(every.get("a").unwrap().checkpoint_every, Some(5));
        let timed = Catalog::parse("[[model]]\nname = \"a\"\nkind = \"diffusion\"\ncheckpoint_every_seconds = 30").unwrap();
        assert_eq!(timed.get("a").unwrap().checkpoint_every_seconds, Some(30));
    }

    /// A FLUX entry: flow_euler alone, no negative prompt, its encoders' placement.
    #[test]
    fn a_flow_model_takes_flow_euler_and_no_negative_prompt_when_the_catalog_says_so() {
        let c = Catalog::parse(
            "[[model]]\nname = \"flux\"\nkind = \"stable-diffusion\"\nsize_multiple = 16\nsamplers = [\"flow_euler\"]\n\
             default_sampler = \"flow_euler\"\nnegative_prompt = false\ntext_encoders = \"on_demand\"\nt5_max_length = 256\n",
        )
        .unwrap();
        let m = c.get("flux").unwrap();
        assert_eq!(
            (m.text_encoders, m.t5_max_length, m.negative_prompt),
            (Some(TextEncoders::OnDemand), Some(256), false)
        );
        let (_, g) = c
            .normalize(request(serde_json::json!({"model": "flux", "prompt": "x"})), || 0)
            .unwrap();
        assert_eq!(g.sampler, "flow_euler");
        let e = c
            .normalize(
                request(serde_json::json!({"model": "flux", "prompt": "x", "negative_prompt": "blurry"})),
                || 0,
            )
            .unwrap_err();
        assert_eq!(e[0].field, "negative_prompt");
        let e = c
            .normalize(
                request(serde_json::json!({"model": "flux", "prompt": "x", "sampler": "euler"})),
                || 0,
            )
            .unwrap_err();
        assert_eq!(e[0].field, "sampler");
        // Other models take a negative prompt unless told otherwise.
        assert!(Catalog::parse(SD).unwrap().get("sd-tiny").unwrap().negative_prompt);
    }
}
