//! The status view: every task's state, materialized from the topics into an embedded store
//! (redb, one file on local disk) so that HTTP clients can ask for it.
//!
//! Every state change is a Kafka record — the task record (queued), progress records (running,
//! step n/N), the completion (succeeded, failed) — and every producer replica reads every
//! partition of those topics itself (no consumer group), so any replica answers for any task.
//! The store keeps, in the same transactions as the changes, how far it has read each
//! partition: a replica restarted on the same volume opens it and reads on from there, instead
//! of rebuilding it from the topics (a store of another format, or none, is rebuilt). It keeps
//! tasks for a retention period. The 202 path writes its task through, so a task accepted a
//! moment ago is `queued`, never a 404.
//!
//! In parts: the record types here; `merge`, the rules by which a state change updates a task's
//! status (pure functions on those types); `store`, the redb tables and their transactions;
//! `identity`, the cluster and topic ids a store is read from (a store of another cluster, or of
//! topics since re-created, is rebuilt); and `feed`, the thread that reads the topics into the
//! store.

pub(crate) mod feed;
pub(crate) mod identity;
mod merge;
mod store;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sluice_schemas::{CompletionError, CompletionEvent, OutputRef, ProgressRecord, TaskRecord, Timings};
use thiserror::Error;
use uuid::Uuid;

pub use feed::{CaughtUp, FeedError};
pub use store::{MAX_LIST_SCAN, StatusStore, cursor_key};

#[derive(Debug, Error)]
pub enum StatusError {
    #[error("status store: {0}")]
    Store(String),
    #[error("not a cursor of this API: {0:?}")]
    Cursor(String),
}

/// Where a task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Expired,
}

impl From<sluice_schemas::CompletionStatus> for Status {
    /// Where a completion leaves its task.
    fn from(status: sluice_schemas::CompletionStatus) -> Status {
        use sluice_schemas::CompletionStatus::*;
        match status {
            Succeeded => Status::Succeeded,
            Failed => Status::Failed,
            Cancelled => Status::Cancelled,
            Expired => Status::Expired,
        }
    }
}

impl Status {
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Succeeded | Status::Failed | Status::Cancelled | Status::Expired)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
            Status::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        match s {
            "queued" => Some(Status::Queued),
            "running" => Some(Status::Running),
            "succeeded" => Some(Status::Succeeded),
            "failed" => Some(Status::Failed),
            "cancelled" => Some(Status::Cancelled),
            "expired" => Some(Status::Expired),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    pub step: u32,
    pub steps: u32,
    /// The step this attempt carried on from (its step checkpoint's), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u32>,
}

/// The body of `GET /v1/tasks/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskStatus {
    pub task_id: Uuid,
    pub status: Status,
    pub model: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub progress: Option<Progress>,
    pub outputs: Vec<OutputRef>,
    pub error: Option<CompletionError>,
    pub timings: Option<Timings>,
    pub attempt: u32,
}

/// What the store keeps of a task: its status and whose it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stored {
    tenant: String,
    status: TaskStatus,
    /// The request hash of a task submitted with an `Idempotency-Key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request_sha256: Option<String>,
    /// Where the task's events are pushed, from its record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    webhook: Option<sluice_schemas::WebhookSpec>,
    /// Known from its completion only: its record (and with it its webhook) not read yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    awaiting_record: bool,
}

/// One state change, from a record of one of the topics.
#[derive(Debug, Clone)]
pub enum Change {
    Queued(TaskRecord),
    /// The task's record sent back by a redrive, as attempt `attempt` (its `sluice-attempt`),
    /// at `at`.
    Redriven {
        record: TaskRecord,
        attempt: u32,
        at: DateTime<Utc>,
    },
    Progress(ProgressRecord),
    Completed(CompletionEvent),
}

/// A task as the webhook notifier sees it: see [`StatusStore::with_webhook`].
#[derive(Debug, Clone)]
pub struct WebhookTarget {
    pub tenant: String,
    /// `None`: the task has no webhook (or its record, which would say, is not read yet).
    pub webhook: Option<sluice_schemas::WebhookSpec>,
    /// Its record not read yet: whether it has a webhook is not known.
    pub awaiting_record: bool,
    pub status: TaskStatus,
}

/// A page of a tenant's tasks.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub tasks: Vec<TaskStatus>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}
