//! Model adapters: "task parameters → input tensors → images" for each model. The engine and the
//! batcher don't know which model runs; an adapter knows nothing of Kafka.

pub mod noise;
pub mod terrain;

use std::any::Any;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;

use crate::encode::Image;
use crate::engine::{Backend, EngineError, OrtBackend, Runtime, SessionOptions, Tensor};

/// Tasks of one bucket can run in one model call and use the same memory per task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket {
    pub model: String,
    /// Rows (entries on the model's batch axis) each task of the bucket needs.
    pub rows_per_task: usize,
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.model, self.rows_per_task)
    }
}

/// A task's model inputs, made on the CPU before its batch runs.
pub struct Prepared {
    /// The task's rows of every model input (batch on axis 0).
    pub inputs: Vec<Tensor>,
    pub rows: usize,
    /// What the adapter needs to turn the outputs back into images.
    pub layout: Box<dyn Any + Send + Sync>,
}

/// Turns tasks of one model into inputs and outputs back into images.
pub trait ModelAdapter: Send + Sync {
    fn name(&self) -> &str;
    /// The bucket of a task. Tasks with different buckets are never batched together.
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, String>;
    /// The task's input rows. CPU work, run off the async runtime.
    fn prepare(&self, task: &TaskRecord) -> Result<Prepared, String>;
    /// The task's images from its `rows` of the batch `outputs`. CPU work.
    fn render(&self, task: &TaskRecord, prepared: &Prepared, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, String>;
    /// Loads the model on one engine thread.
    fn load(&self, runtime: &Runtime, path: &Path, options: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
        Ok(Box::new(OrtBackend::load(runtime, path, options)?))
    }
    /// Facts about a task for logs and the DLQ (its dimensions).
    fn describe(&self, task: &TaskRecord) -> serde_json::Map<String, serde_json::Value> {
        let r = &task.request;
        let mut m = serde_json::Map::new();
        m.insert("width".into(), r.width.into());
        m.insert("height".into(), r.height.into());
        m.insert("num_images".into(), r.num_images.into());
        m
    }
}

/// The adapter of a served model name.
pub fn adapter_for(model: &str) -> Option<Arc<dyn ModelAdapter>> {
    match model {
        terrain::NAME => Some(Arc::new(terrain::Terrain)),
        _ => None,
    }
}

/// Concatenates the inputs of several tasks along the batch axis.
pub fn concat_inputs(parts: &[&Prepared]) -> Vec<Tensor> {
    let Some(first) = parts.first() else { return Vec::new() };
    (0..first.inputs.len())
        .map(|i| Tensor::concat(&parts.iter().map(|p| &p.inputs[i]).collect::<Vec<_>>()))
        .collect()
}
