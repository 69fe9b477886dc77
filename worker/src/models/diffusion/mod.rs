//! Diffusion models from an Optimum ONNX export, the family read from `model_index.json`:
//! Stable Diffusion 1.x/2.x, SD-Turbo, LCM and SDXL (CLIP text encoders, a UNet loop under one
//! of the [`schedulers`], the VAE decoder) and the flow-matching transformers FLUX.1 and SD3
//! ([`flow`]).
//!
//! [`layout`] reads a model's directory, [`unet`] runs the UNet families and [`flow`] the
//! transformers; [`request`] turns a task into inputs and outputs into PNGs for both.

mod adapter;
pub mod flow;
pub mod input;
pub mod layout;
pub mod npy;
mod python_json;
pub mod request;
pub mod schedulers;
mod stages;
pub mod tokenizer;
pub mod unet;

use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;

use self::flow::backend::EncoderPlacement;
use self::flow::layout::{FlowFamily, FlowLayout};
use self::layout::{LayoutError, SdLayout};
use self::request::{Draws, ImageInput, SdBucket, SdRender, SdRequest};
use self::schedulers::Sampler;
use super::{Bucket, InputImages, Prepared};
use crate::engine::Runtime;

/// The `kind` of diffusion models in the catalog (`stable-diffusion` is still read).
pub const KIND: &str = "diffusion";

/// A diffusion model served under `name`.
pub struct StableDiffusion {
    name: String,
    runtime: Arc<Runtime>,
    pipeline: Pipeline,
    /// The catalog's `checkpoint_every` and `checkpoint_every_seconds`: its tasks' state is kept
    /// every that many steps, and that long after it was last kept.
    checkpoint_every: Option<usize>,
    checkpoint_seconds: Option<std::time::Duration>,
}

/// Which pipeline runs the model, with what the CPU side read from its directory.
pub enum Pipeline {
    /// SD 1.x/2.x, SD-Turbo, LCM, SDXL.
    Unet(Arc<SdLayout>),
    /// FLUX.1, SD3.
    Flow(Arc<FlowLayout>, FlowSettings),
}

/// The catalog's settings of a flow transformer (ignored for the UNet families).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowSettings {
    pub text_encoders: EncoderPlacement,
    /// T5's window; the pipeline's default when `None`.
    pub t5_max_length: Option<usize>,
}

impl FlowSettings {
    /// A catalog entry's settings.
    pub fn of(entry: &sluice_schemas::CatalogModel) -> FlowSettings {
        FlowSettings {
            text_encoders: match entry.text_encoders {
                None | Some(sluice_schemas::TextEncoders::Device) => EncoderPlacement::Device,
                Some(sluice_schemas::TextEncoders::Cpu) => EncoderPlacement::Cpu,
                Some(sluice_schemas::TextEncoders::OnDemand) => EncoderPlacement::OnDemand,
            },
            t5_max_length: entry.t5_max_length.map(|l| l as usize),
        }
    }
}

impl StableDiffusion {
    /// Reads the model directory (configs and tokenizers; sessions load on the engine threads)
    /// with the default settings.
    pub fn open(runtime: Arc<Runtime>, name: &str, dir: &Path) -> Result<StableDiffusion, LayoutError> {
        Self::open_with(runtime, name, dir, FlowSettings::default())
    }

    pub fn open_with(runtime: Arc<Runtime>, name: &str, dir: &Path, settings: FlowSettings) -> Result<StableDiffusion, LayoutError> {
        let pipeline = match FlowFamily::detect(dir, &layout::model_index(dir)?) {
            Some(family) => Pipeline::Flow(Arc::new(FlowLayout::open(dir, family, settings.t5_max_length)?), settings),
            None => Pipeline::Unet(Arc::new(SdLayout::open(dir)?)),
        };
        Ok(StableDiffusion {
            name: name.to_owned(),
            runtime,
            pipeline,
            checkpoint_every: None,
            checkpoint_seconds: None,
        })
    }

    /// Keeps its tasks' state every `every` steps and `seconds` after it was last kept (the
    /// catalog's `checkpoint_every` and `checkpoint_every_seconds`).
    pub fn checkpointing(mut self, every: Option<u32>, seconds: Option<u32>) -> StableDiffusion {
        self.checkpoint_every = every.map(|n| n as usize);
        self.checkpoint_seconds = seconds.map(|s| std::time::Duration::from_secs(s.into()));
        self
    }

    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// Whether a catalog entry offers only what the model runs: flow_euler for the flow
    /// transformers and only for them, no negative prompt for FLUX.1. Otherwise every request
    /// the catalog admits and the model refuses would go to the DLQ.
    pub fn fits_catalog(&self, entry: &sluice_schemas::CatalogModel) -> Result<(), String> {
        let flow = matches!(self.pipeline, Pipeline::Flow(..));
        if let Some(s) = entry
            .samplers
            .iter()
            .find(|s| Sampler::parse(s).is_some_and(Sampler::for_flow_models) != flow)
        {
            return Err(format!(
                "the catalog offers sampler {s:?}, which this {} model does not run (flow_euler is for FLUX.1 and SD3 alone)",
                self.family()
            ));
        }
        if let Pipeline::Flow(l, _) = &self.pipeline
            && l.family == FlowFamily::Flux
            && entry.negative_prompt
        {
            return Err("the catalog takes a negative prompt, which FLUX.1 does not (set negative_prompt = false)".into());
        }
        Ok(())
    }

    /// What a width or height must be a multiple of.
    pub fn size_multiple(&self) -> usize {
        match &self.pipeline {
            Pipeline::Unet(l) => l.size_multiple,
            Pipeline::Flow(l, _) => l.size_multiple(),
        }
    }

    /// The family, for messages.
    pub fn family(&self) -> String {
        match &self.pipeline {
            Pipeline::Unet(l) => format!("{:?}", l.family),
            Pipeline::Flow(l, _) => l.family.name().to_owned(),
        }
    }

    /// Checks a request against the model; the number of per-step noise draws it makes.
    pub fn check(&self, request: &SdRequest) -> Result<usize, String> {
        match &self.pipeline {
            Pipeline::Unet(l) => Ok(request.check(l)?.noise_draws()),
            Pipeline::Flow(l, _) => flow::request::check(request, l).map(|_| 0),
        }
    }

    /// One image's latent shape.
    pub fn latent_dims(&self, request: &SdRequest) -> [usize; 3] {
        match &self.pipeline {
            Pipeline::Unet(l) => request.latent_dims(l),
            Pipeline::Flow(l, _) => flow::request::latent_dims(request, l),
        }
    }

    fn bucket_of(&self, request: &SdRequest) -> SdBucket {
        match &self.pipeline {
            Pipeline::Unet(l) => request.bucket(l),
            Pipeline::Flow(l, _) => flow::request::bucket(request, l),
        }
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
            sampler: Sampler::parse(&r.sampler).ok_or_else(|| format!("sampler {:?} is not one of {}", r.sampler, Sampler::names()))?,
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
        let draws = self.check(request)?;
        let draws_of = draws_of.unwrap_or_else(|| request.seeded_draws(self.latent_dims(request), draws));
        let inputs = match &self.pipeline {
            Pipeline::Unet(l) => request.inputs(l, draws_of, draws)?,
            Pipeline::Flow(l, _) => flow::request::inputs(request, l, draws_of)?,
        };
        let bucket = Bucket {
            model: self.name.clone(),
            key: self.bucket_of(request).key(),
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
