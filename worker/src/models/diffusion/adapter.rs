//! Stable Diffusion, SDXL, FLUX.1 and SD3 as a model adapter: how the worker's pipeline asks for
//! a task's bucket, inputs and rendering.

use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;

use super::flow::backend::FlowBackend;
use super::flow::layout::FlowLayout;
use super::layout::{LayoutError, SdLayout};
use super::request::{Mode, SdRequest};
use super::unet::backend::SdBackend;
use super::{Pipeline, StableDiffusion};
use crate::engine::{Backend, CallKey, EngineError, SessionOptions, Stepped};
use crate::models::{Bucket, InputImages, ModelAdapter, ModelError, Prepared};

impl ModelAdapter for StableDiffusion {
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError> {
        let request = Self::request(task, None).map_err(ModelError::InvalidInput)?;
        // At admission: a request the model cannot run is a violation.
        self.check(&request).map_err(ModelError::InvalidInput)?;
        match &self.pipeline {
            Pipeline::Unet(l) => request.mode().servable_by(l).map_err(ModelError::InvalidInput)?,
            Pipeline::Flow(..) if request.mode() != Mode::Text => {
                return Err(ModelError::InvalidInput("init_image: flow transformers take no input image".into()));
            }
            Pipeline::Flow(..) => {}
        }
        Ok(Bucket {
            model: self.name.clone(),
            key: self.key_of(&request),
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
        let load = |e: LayoutError| EngineError::Load(e.to_string());
        match &self.pipeline {
            Pipeline::Unet(_) => {
                let layout = SdLayout::open(path).map_err(load)?;
                Ok(Box::new(SdBackend::load(&self.runtime, Arc::new(layout), path, options)?))
            }
            Pipeline::Flow(l, settings) => {
                let layout = FlowLayout::open(path, l.family, settings.t5_max_length).map_err(load)?;
                Ok(Box::new(FlowBackend::load(
                    self.runtime.clone(),
                    Arc::new(layout),
                    options,
                    settings.text_encoders,
                )?))
            }
        }
    }

    fn describe(&self, task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
        let r = &task.request;
        let mut m = crate::models::dimensions(task);
        m.insert("steps".into(), r.steps.into());
        m.insert("sampler".into(), r.sampler.clone().into());
        m
    }
}

impl StableDiffusion {
    /// A request's bucket key, with the catalog's checkpoint interval.
    fn key_of(&self, request: &SdRequest) -> CallKey {
        let key = self.bucket_of(request).key();
        match key.steps().cloned() {
            Some(stepped) if self.checkpoint_every.is_some() || self.checkpoint_seconds.is_some() => key.stepped(Stepped {
                checkpoint_every: self.checkpoint_every,
                checkpoint_seconds: self.checkpoint_seconds,
                ..stepped
            }),
            _ => key,
        }
    }
}
