//! Why a task failed, as its DLQ record and its failed completion report it.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sluice_schemas::DlqReason;

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
