//! What travels through the pipeline: a record with its origin, and the task decoded from it.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sluice_schemas::{DlqReason, SourceRef, TaskRecord};

/// Where a record was read from, and under which assignment. Whatever stage finishes a task
/// acknowledges its origin to [`crate::source::offsets::Offsets`]; nothing else commits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    /// The assignment the record was read under; an acknowledgement from an older assignment of
    /// the partition is ignored (the partition was revoked in between).
    pub generation: u64,
}

impl Origin {
    pub fn source_ref(&self) -> SourceRef {
        SourceRef {
            topic: self.topic.to_string(),
            partition: self.partition,
            offset: self.offset,
        }
    }
}

/// A record as read from the tasks topic, kept byte for byte for the DLQ.
#[derive(Debug, Clone)]
pub struct Record {
    pub origin: Origin,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: sluice_schemas::RawHeaders,
    pub timestamp_ms: Option<i64>,
    pub received_at: Instant,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == name).and_then(|(_, v)| v.as_deref())
    }

    /// The attempt this delivery is: 1, or what a redrive recorded in `sluice-attempt`.
    pub fn attempt(&self) -> u32 {
        self.header(sluice_schemas::HEADER_ATTEMPT)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse().ok())
            .filter(|a| *a >= 1)
            .unwrap_or(1)
    }
}

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
}

impl Job {
    /// Milliseconds from submission to `now`, 0 if the clocks disagree.
    pub fn age_ms(&self, now: DateTime<Utc>) -> u64 {
        (now - self.task.submitted_at).num_milliseconds().max(0) as u64
    }
}

/// Why a task failed, as the DLQ and the failed completion report it.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub reason: DlqReason,
    pub message: String,
    pub details: Option<Map<String, Value>>,
    pub attempts: u32,
    pub first_failed_at: DateTime<Utc>,
}

impl Failure {
    pub fn new(reason: DlqReason, message: impl Into<String>) -> Failure {
        Failure {
            reason,
            message: message.into(),
            details: None,
            attempts: 1,
            first_failed_at: Utc::now(),
        }
    }

    pub fn with_details(mut self, details: Map<String, Value>) -> Failure {
        self.details = Some(details);
        self
    }

    /// Details naming each violating field: `{"violations": [{field, message}]}`.
    pub fn with_violations(self, violations: &[sluice_schemas::Violation]) -> Failure {
        let fields = violations
            .iter()
            .map(|v| serde_json::json!({"field": v.field, "message": v.message}))
            .collect();
        self.with_details([("violations".to_owned(), Value::Array(fields))].into_iter().collect())
    }
}
