//! Stable Diffusion (1.x, 2.x, SD-Turbo, LCM) from an Optimum ONNX export: CLIP tokenizer and
//! text encoder, a UNet loop under one of the [`schedulers`], the VAE decoder.
//!
//! The pieces are split so that SDXL can reuse them: [`layout`] reads a model directory,
//! [`request`] turns a task into inputs and outputs into PNGs, [`backend`] runs the sessions.

pub mod backend;
mod image;
pub mod input;
pub mod layout;
pub mod npy;
mod python_json;
pub mod request;
pub mod schedulers;
pub mod tokenizer;

use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;

use self::backend::SdBackend;
use self::layout::{LayoutError, SdLayout};
use self::request::{Draws, ImageInput, SdRender, SdRequest};
use self::schedulers::Sampler;
use super::{Bucket, InputImages, ModelAdapter, ModelError, Prepared};
use crate::engine::{Backend, EngineError, Runtime, SessionOptions};

/// The `kind` of Stable Diffusion models in the catalog.
pub const KIND: &str = "stable-diffusion";

/// A Stable Diffusion model served under `name`.
pub struct StableDiffusion {
    name: String,
    runtime: Arc<Runtime>,
    layout: Arc<SdLayout>,
}

impl StableDiffusion {
    /// Reads the model directory (configs and tokenizer; sessions load on the engine threads).
    pub fn open(runtime: Arc<Runtime>, name: &str, dir: &Path) -> Result<StableDiffusion, LayoutError> {
        Ok(StableDiffusion {
            name: name.to_owned(),
            runtime,
            layout: Arc::new(SdLayout::open(dir)?),
        })
    }

    pub fn layout(&self) -> &SdLayout {
        &self.layout
    }

    /// The request a task record asks for, with its input images decoded when `inputs` holds
    /// them. Without them (at admission) an image task's request has the mode and strength its
    /// bucket needs and no pixels.
    pub fn request(task: &TaskRecord, inputs: Option<&InputImages>) -> Result<SdRequest, String> {
        let r = &task.request;
        let image = match (r.strength, inputs) {
            (None, _) => None,
            (Some(strength), None) => Some(ImageInput::pending(strength, r.mask_image.is_some())),
            (Some(strength), Some(inputs)) => {
                let init = inputs.init.as_deref().ok_or("the task's init_image was not read")?;
                let mask = match (&r.mask_image, &inputs.mask) {
                    (None, _) => None,
                    (Some(_), Some(bytes)) => Some(bytes.as_ref()),
                    (Some(_), None) => return Err("the task's mask_image was not read".into()),
                };
                Some(input::image_input(init, mask, strength, r.width as usize, r.height as usize)?)
            }
        };
        Ok(SdRequest {
            prompt: r.prompt.clone(),
            negative_prompt: r.negative_prompt.clone(),
            steps: r.steps as usize,
            guidance_scale: r.guidance_scale as f32,
            sampler: Sampler::parse(&r.sampler).ok_or_else(|| format!("sampler {:?} is not one of {}", r.sampler, sampler_names()))?,
            width: r.width as usize,
            height: r.height as usize,
            num_images: r.num_images as usize,
            seed: r.seed,
            image,
        })
    }

    /// The inputs of `request` from the given standard-normal draws (seeded ones when `None`),
    /// and the call's bucket.
    pub fn prepare_request(&self, request: &SdRequest, draws_of: Option<Draws>) -> Result<(Bucket, Prepared), String> {
        let schedule = request.check(&self.layout)?;
        let draws = schedule.noise_draws();
        let draws_of = draws_of.unwrap_or_else(|| request.seeded_draws(&self.layout, draws));
        let inputs = request.inputs(&self.layout, draws_of, draws)?;
        let bucket = Bucket {
            model: self.name.clone(),
            key: request.bucket(&self.layout).key(),
            rows_per_task: request.num_images,
            alone: None,
        };
        let prepared = Prepared {
            inputs,
            rows: request.num_images,
            render: Box::new(SdRender {
                width: request.width,
                height: request.height,
            }),
        };
        Ok((bucket, prepared))
    }
}

/// Every sampler name, for messages.
pub fn sampler_names() -> String {
    Sampler::ALL.map(Sampler::name).join(", ")
}

impl ModelAdapter for StableDiffusion {
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError> {
        let request = Self::request(task, None).map_err(ModelError::InvalidInput)?;
        // At admission: a request the model cannot run is a violation.
        request.check(&self.layout).map_err(ModelError::InvalidInput)?;
        request.mode().servable_by(&self.layout).map_err(ModelError::InvalidInput)?;
        Ok(Bucket {
            model: self.name.clone(),
            key: request.bucket(&self.layout).key(),
            rows_per_task: request.num_images,
            alone: None,
        })
    }

    fn prepare(&self, task: &TaskRecord, inputs: &InputImages) -> Result<Prepared, ModelError> {
        let request = Self::request(task, Some(inputs)).map_err(ModelError::InvalidInput)?;
        Ok(self.prepare_request(&request, None).map_err(ModelError::InvalidInput)?.1)
    }

    fn entry(&self) -> Option<&'static str> {
        None
    }

    fn steps(&self, task: &TaskRecord) -> Option<u32> {
        Some(task.request.steps)
    }

    fn load(&self, path: &Path, options: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
        // Read the directory again: a reload may bring a new scheduler config or VAE factor.
        let layout = SdLayout::open(path).map_err(|e| EngineError::Load(e.to_string()))?;
        Ok(Box::new(SdBackend::load(&self.runtime, Arc::new(layout), path, options)?))
    }

    fn describe(&self, task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
        let r = &task.request;
        let mut m = super::dimensions(task);
        m.insert("steps".into(), r.steps.into());
        m.insert("sampler".into(), r.sampler.clone().into());
        m
    }
}
