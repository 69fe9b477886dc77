//! What travels through the pipeline: the task decoded from a record (`source::record`), with
//! what the stages attach to it.

use chrono::{DateTime, Utc};
use sluice_schemas::TaskRecord;

use crate::source::record::Record;

/// A decoded task on its way through the pipeline.
#[derive(Debug)]
pub struct Job {
    pub record: Record,
    pub task: TaskRecord,
    pub span: tracing::Span,
    /// This record's hold on its task id (see `running`): dropped with the job.
    pub(crate) claim: Option<crate::pipeline::running::Claim>,
    /// Its input images, read just before it runs (empty for a text task, and until then).
    pub inputs: crate::models::InputImages,
    /// Its bucket keeps durable step checkpoints (the catalog's `checkpoint_every`), and one
    /// falls due before its last step.
    pub(crate) checkpointed: bool,
    /// Where it carries on, from its latest checkpoint (a task that ran before).
    pub(crate) resume: Option<crate::batching::steps::Resume>,
    /// How many step checkpoints of it are stored: each is a step some earlier run reached, the
    /// progress the crash guard credits against its starts.
    pub(crate) checkpoints_stored: u32,
}

impl Job {
    /// Milliseconds from submission to `now`, 0 if the clocks disagree.
    pub fn age_ms(&self, now: DateTime<Utc>) -> u64 {
        (now - self.task.submitted_at).num_milliseconds().max(0) as u64
    }
}

impl crate::batching::batcher::Work for Job {
    fn lane(&self) -> sluice_schemas::Priority {
        self.task.priority
    }
    fn tenant(&self) -> &str {
        &self.task.tenant
    }
}
