//! The stages of one task's life, joined by bounded channels:
//!
//! ```text
//! source ─▶ decode ─▶ batcher ─▶ engine ─▶ finish (render, sink) ─▶ outcome ─▶ offsets
//! ```
//!
//! Every task carries its origin; whichever stage finishes it hands it to [`Outcomes`], the one
//! place that announces outcomes and acknowledges offsets. One file per stage: [`decode`] (parse,
//! admit, look for earlier results, the crash guard's verdict), [`run`] (the engine stage: a
//! batch's tasks prepared and run through the adaptive batcher), [`finish`] (render, store,
//! announce); the source is [`crate::source`], the batcher [`crate::batching`]. Each stage takes
//! a context of its own ([`DecodeStage`], [`EngineStage`], [`FinishStage`]) holding only what it
//! touches.

mod decode;
mod engine_stage;
mod finish;
mod gauges;
pub(crate) mod running;
pub(crate) mod task;

pub(crate) use decode::decode;
pub(crate) use engine_stage::engine;
pub(crate) use gauges::gauges;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::batching::adaptive::{Adaptive, BatchItem};
use crate::metrics::Metrics;
use crate::models::Prepared;
use crate::models::serving::Serving;
use crate::outcome::Outcomes;
use crate::outcome::progress::ProgressSink;
use crate::pipeline::running::Running;
use crate::pipeline::task::Job;
use crate::retry::{GaveUp, RetryPolicy, retry};
use crate::source::cancellations::Cancellations;
use crate::source::crash_guard::CrashGuard;
use crate::source::offsets::Offsets;
use crate::source::redelivery::RedeliveryCheck;
use crate::storage::images::{ImageStore, StorageError};

/// What the decode stage touches: parse and admit, look for earlier results, the crash guard.
pub(crate) struct DecodeStage {
    pub offsets: Arc<Offsets>,
    pub redelivery: Arc<dyn RedeliveryCheck>,
    /// Task ids in flight: a second record of one waits for the first, then for its results.
    pub running: Arc<Running>,
    /// Sends records that keep killing workers to the DLQ.
    pub crash_guard: Arc<CrashGuard>,
    /// Which models are served (and their adapters' buckets).
    pub serving: Arc<Serving>,
    /// The served models' entries: the bounds of one task's work.
    pub catalog: Arc<sluice_schemas::Catalog>,
    pub max_task_bytes: usize,
    /// Where earlier results are looked for.
    pub store: Arc<RetriedStore>,
    pub outcomes: Outcomes,
    /// Every spawned per-task future, so shutdown can wait for them.
    pub tasks: TaskTracker,
}

/// What the engine stage touches: which tasks are still wanted, their model inputs, the
/// adaptive batcher, and the finish stage it hands what ran to.
pub(crate) struct EngineStage {
    pub offsets: Arc<Offsets>,
    /// Tasks cancelled by their clients (the control topic).
    pub cancellations: Cancellations,
    pub serving: Arc<Serving>,
    pub adaptive: Arc<Adaptive>,
    /// Records model calls' starts, runs suspects alone.
    pub crash_guard: Arc<CrashGuard>,
    /// Progress records of multi-step models (none in unit tests).
    pub progress: Option<ProgressSink>,
    pub outcomes: Outcomes,
    pub tasks: TaskTracker,
    pub finish: Arc<FinishStage>,
}

/// What the finish stage touches: rendering permits, the store, outcomes.
pub(crate) struct FinishStage {
    /// Bounds tasks being rendered and stored at once.
    pub permits: Semaphore,
    pub store: Arc<RetriedStore>,
    pub outcomes: Outcomes,
    /// Written into each task's manifest.
    pub worker_id: String,
}

/// The image store as the stages use it: each operation retried within `retry`, given up when
/// the worker abandons what is in flight (shutdown grace over, fatal error).
pub(crate) struct RetriedStore {
    pub images: ImageStore,
    /// Where input images are read from (`SLUICE_INPUT_URL`), when configured.
    pub inputs: Option<ImageStore>,
    pub retry: RetryPolicy,
    pub metrics: Metrics,
    pub abandon: CancellationToken,
}

impl RetriedStore {
    /// Runs `op` on the store under the retry policy; `operation` labels the retry metrics.
    async fn run<T, F, Fut>(&self, operation: &'static str, op: F) -> Result<T, GaveUp<StorageError>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StorageError>>,
    {
        retry(self.retry, operation, &self.metrics, &self.abandon, op).await
    }
}

/// A prepared task inside a batch.
struct Item {
    job: Job,
    prepared: Prepared,
    progress: Option<Arc<crate::outcome::progress::TaskProgress>>,
}

impl BatchItem for Item {
    fn prepared(&self) -> &Prepared {
        &self.prepared
    }
    fn id(&self) -> String {
        self.job.task.task_id.to_string()
    }
    fn attempt(&self) -> u32 {
        self.job.record.attempt()
    }
    fn dimensions(&self) -> String {
        let r = &self.job.task.request;
        format!("{}x{}x{}", r.width, r.height, r.num_images)
    }
    fn lane(&self) -> sluice_schemas::Priority {
        crate::batching::batcher::Work::lane(&self.job)
    }
    fn hooks(&self) -> Option<Arc<dyn crate::engine::TaskHooks>> {
        self.progress.clone().map(|p| p as Arc<dyn crate::engine::TaskHooks>)
    }
    fn resume(&self) -> Option<&crate::batching::steps::Resume> {
        self.job.resume.as_ref()
    }
}

#[cfg(test)]
mod tests;
