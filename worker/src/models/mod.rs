//! Model adapters: "task parameters → input tensors → images" for each kind of model. The engine
//! and the batcher don't know which model runs; an adapter knows nothing of Kafka.

pub mod encode;
pub(crate) mod serving;

pub mod diffusion;
pub(crate) mod noise;
pub mod terrain;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;

use crate::engine::{Backend, CallKey, EngineError, SessionOptions, Tensor};
use crate::models::encode::Image;

/// Why an adapter could not do what the pipeline asked of it. Each kind has one outcome: the
/// pipeline decides by the kind, never by a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The task asks for what the model cannot do (a size, sampler or parameter out of its
    /// range): the client's mistake, a DLQ `schema_violation`.
    #[error("{0}")]
    InvalidInput(String),
    /// The task was cancelled by its client between sampler steps: nothing is rendered or stored.
    #[error("cancelled")]
    Cancelled,
    /// The model's outputs could not become images (missing, wrong size): a DLQ `model_error`.
    #[error("{0}")]
    Failed(String),
    /// Model code panicked, caught: a DLQ `model_error` with the panic's message.
    #[error("{0}")]
    Panicked(String),
}

impl ModelError {
    /// The kind as a metric label and log field.
    pub fn error_type(&self) -> &'static str {
        match self {
            ModelError::InvalidInput(_) => "invalid_input",
            ModelError::Cancelled => "cancelled",
            ModelError::Failed(_) => "failed",
            ModelError::Panicked(_) => "panicked",
        }
    }
}

/// Tasks of one bucket can run in one model call and use the same memory per task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket {
    pub model: String,
    /// What else tasks must share to run in one call, in the adapter's own type (for Stable
    /// Diffusion: size, sampler, steps, guidance on or off); [`CallKey::none`] when the model
    /// needs nothing more.
    pub key: CallKey,
    /// Rows (entries on the model's batch axis) each task of the bucket needs.
    pub rows_per_task: usize,
    /// The record (partition, offset) of a task that must run in a call of its own: one
    /// suspected of killing an earlier worker (the crash guard). `None` for every other.
    pub alone: Option<(i32, i64)>,
}

impl Bucket {
    /// The bucket's metric label: its model and a size class, `le<N>` with N the power of two
    /// at or above the task's work (its rows, times the pixels of one image where the key knows
    /// them, as Stable Diffusion's does). The bucket itself (one per size × sampler × steps × guidance ×
    /// rows) would mint a series per combination a client can ask for; the classes are a few
    /// dozen per model at most. Logs name the bucket itself.
    pub fn label(&self) -> String {
        let pixels = self.key.pixels().unwrap_or(1);
        let work = pixels.saturating_mul(self.rows_per_task.max(1) as u64).max(1);
        format!("{}:le{}", self.model, work.checked_next_power_of_two().unwrap_or(u64::MAX))
    }

    /// The bucket as events report it: plain data.
    pub(crate) fn name(&self) -> crate::events::BucketName {
        crate::events::BucketName {
            name: self.to_string(),
            label: self.label(),
            model: self.model.clone(),
            rows_per_task: self.rows_per_task,
        }
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.name().is_empty() {
            write!(f, "{}:{}", self.model, self.rows_per_task)
        } else {
            write!(f, "{}:{}:{}", self.model, self.key, self.rows_per_task)
        }
    }
}

/// A task's model inputs, made on the CPU before its batch runs, and how to turn its share of
/// the outputs back into images.
pub struct Prepared {
    /// The task's rows of every model input (batch on axis 0).
    pub inputs: Vec<Tensor>,
    /// Rows of the outputs that belong to the task.
    pub rows: usize,
    pub render: Box<dyn Render>,
}

/// Turns a task's rows of a batch's outputs into its images. Made by the adapter with the task's
/// own layout, so it needs nothing else.
pub trait Render: Send + Sync {
    /// CPU work, run off the async runtime.
    fn render(&self, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, ModelError>;
}

/// A task's input images (img2img, inpainting) as stored, read at decode from the input store
/// and checked against the hashes its record carries; empty for a text task.
#[derive(Debug, Clone, Default)]
pub struct InputImages {
    pub init: Option<bytes::Bytes>,
    pub mask: Option<bytes::Bytes>,
}

/// Turns tasks of one kind of model into inputs, and loads that kind of model.
pub trait ModelAdapter: Send + Sync {
    /// The bucket of a task. Tasks with different buckets are never batched together.
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError>;
    /// The task's input rows. CPU work, run off the async runtime.
    fn prepare(&self, task: &TaskRecord, inputs: &InputImages) -> Result<Prepared, ModelError>;
    /// The file inside the model's directory that [`ModelAdapter::load`] gets; `None` when it
    /// gets the directory itself (a model of several files).
    fn entry(&self) -> Option<&'static str> {
        Some("model.onnx")
    }
    /// Loads the model at `path` (see [`ModelAdapter::entry`]); called once on every engine
    /// thread.
    fn load(&self, path: &Path, options: &SessionOptions) -> Result<Box<dyn Backend>, EngineError>;
    /// The sampler steps of a task, for models that report progress between steps (and read
    /// its cancellation flag); `None` for single-call models.
    fn steps(&self, _task: &TaskRecord) -> Option<u32> {
        None
    }
    /// Facts about a task for logs and the DLQ (its dimensions).
    fn describe(&self, task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
        dimensions(task)
    }
}

/// A task's width, height and number of images: what every model's description starts with.
pub fn dimensions(task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
    let r = &task.request;
    let mut m = serde_json::Map::new();
    m.insert("width".into(), r.width.into());
    m.insert("height".into(), r.height.into());
    m.insert("num_images".into(), r.num_images.into());
    m
}

/// The adapters a worker can serve, by model name.
#[derive(Clone, Default)]
pub struct Registry {
    adapters: BTreeMap<String, Arc<dyn ModelAdapter>>,
}

impl Registry {
    /// The adapters of `served` catalog models (name, directory), on ONNX Runtime. A Stable
    /// Diffusion model's directory is read here (configs, tokenizer): a broken one is an error
    /// naming the model and the file.
    pub fn from_catalog(
        runtime: Arc<crate::engine::Runtime>,
        catalog: &sluice_schemas::Catalog,
        served: &[(String, std::path::PathBuf)],
    ) -> Result<Registry, String> {
        let mut registry = Registry::default();
        for (name, dir) in served {
            let entry = catalog.get(name).ok_or_else(|| format!("model {name} is not in the catalog"))?;
            let adapter: Arc<dyn ModelAdapter> = match entry.kind {
                sluice_schemas::ModelKind::Terrain => Arc::new(terrain::Terrain::new(runtime.clone())),
                sluice_schemas::ModelKind::Diffusion => {
                    let settings = diffusion::FlowSettings::of(entry);
                    let sd = diffusion::StableDiffusion::open_with(runtime.clone(), name, dir, settings)
                        .map_err(|e| format!("model {name}: {e}"))?
                        .checkpointing(entry.checkpoint_every, entry.checkpoint_every_seconds);
                    sd.fits_catalog(entry).map_err(|e| format!("model {name}: {e}"))?;
                    let needed = sd.size_multiple() as u32;
                    if !entry.size_multiple.is_multiple_of(needed) {
                        tracing::warn!(
                            model = %name,
                            catalog = entry.size_multiple,
                            needed,
                            "the catalog's size_multiple admits sizes this model cannot run; \
                             such tasks go to the DLQ as schema_violation (set size_multiple = {needed})"
                        );
                    }
                    Arc::new(sd)
                }
            };
            registry = registry.with(name, adapter);
        }
        Ok(registry)
    }

    /// Adds (or replaces) the adapter of `name`.
    pub fn with(mut self, name: &str, adapter: Arc<dyn ModelAdapter>) -> Registry {
        self.adapters.insert(name.to_owned(), adapter);
        self
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn ModelAdapter>> {
        self.adapters.get(name).cloned()
    }

    /// Every name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.adapters.keys().cloned().collect()
    }

    /// The same registry with every adapter passed through `wrap`.
    pub(crate) fn map(self, wrap: impl Fn(Arc<dyn ModelAdapter>) -> Arc<dyn ModelAdapter>) -> Registry {
        Registry {
            adapters: self.adapters.into_iter().map(|(n, a)| (n, wrap(a))).collect(),
        }
    }
}

/// Concatenates the inputs of several tasks along the batch axis.
pub fn concat_inputs(parts: &[&Prepared]) -> Vec<Tensor> {
    let Some(first) = parts.first() else { return Vec::new() };
    (0..first.inputs.len())
        .map(|i| Tensor::concat(&parts.iter().map(|p| &p.inputs[i]).collect::<Vec<_>>()))
        .collect()
}

#[cfg(test)]
mod tests;
