//! How a task ended, as the outcome stage is told: a success with its outputs, or what failed (a
//! decoded task, or a record that never became one) and who it was.

use std::time::Duration;

use sluice_schemas::{OutputRef, Timings};
use uuid::Uuid;

use crate::pipeline::task::Job;
use crate::source::record::Record;

/// Who a task is, for its completion event: all of it for a decoded task, what could be read for
/// a record that failed to decode.
#[derive(Debug, Clone, Default)]
pub(crate) struct TaskIdentity {
    pub task_id: Option<Uuid>,
    pub tenant: Option<String>,
    pub model: Option<String>,
    pub user: Option<String>,
}

/// What failed: a decoded task, or a record that never became one.
// Moved once per failed task, never stored in bulk: boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Failed {
    Task(Job),
    Record { record: Record, identity: TaskIdentity },
}

impl TaskIdentity {
    pub(super) fn of(task: &sluice_schemas::TaskRecord) -> TaskIdentity {
        TaskIdentity {
            task_id: Some(task.task_id),
            tenant: Some(task.tenant.clone()),
            model: Some(task.model.clone()),
            user: task.user.clone(),
        }
    }
}

impl From<Job> for Failed {
    fn from(job: Job) -> Failed {
        Failed::Task(job)
    }
}

impl Failed {
    /// The task's lane; a record that never became a task is of none, so `standard`.
    pub(super) fn lane(&self) -> sluice_schemas::Priority {
        match self {
            Failed::Task(job) => job.task.priority,
            Failed::Record { .. } => sluice_schemas::Priority::Standard,
        }
    }

    pub(super) fn into_parts(self) -> (TaskIdentity, Record) {
        match self {
            Failed::Task(job) => (TaskIdentity::of(&job.task), job.record),
            Failed::Record { record, identity } => (identity, record),
        }
    }
}

/// How a task succeeded.
pub(crate) struct Success {
    pub outputs: Vec<OutputRef>,
    pub timings: Timings,
    /// Announced again from an earlier attempt's results, not run again.
    pub duplicate: bool,
    pub upload: Duration,
}
