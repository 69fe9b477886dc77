//! Turning a task request into a versioned task record and publishing it.

use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use sluice_schemas::models::MAX_SEED;
use sluice_schemas::{Catalog, HEADER_SCHEMA_VERSION, RecordKind, SCHEMA_VERSION, TaskRecord, TaskRequest, Violation, validate};
use thiserror::Error;
use uuid::Uuid;

use crate::metrics::Metrics;

#[derive(Debug, Error)]
pub enum SubmitError {
    /// The request is invalid; each violation names its field.
    #[error("invalid request: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Violation>),
    /// The broker did not acknowledge the record in time. Nothing was accepted.
    #[error("the task could not be queued: {0}")]
    Unavailable(String),
}

/// Who submits.
#[derive(Debug, Clone)]
pub struct Submitter {
    pub tenant: String,
    pub user: Option<String>,
}

/// Publishes task records, acknowledged by every in-sync replica, idempotently.
#[derive(Clone)]
pub struct TaskPublisher {
    producer: FutureProducer,
    topic: String,
    metrics: Metrics,
}

impl TaskPublisher {
    pub fn new(producer: FutureProducer, topic: String, metrics: Metrics) -> TaskPublisher {
        TaskPublisher { producer, topic, metrics }
    }

    /// Builds the record of a request: validated against `task-request.schema.json` and the
    /// model's catalog entry, every default filled in (a seed drawn if none was given), then
    /// checked as a task record too.
    pub fn record(catalog: &Catalog, request: &Value, submitter: &Submitter) -> Result<TaskRecord, SubmitError> {
        validate(RecordKind::TaskRequest, request).map_err(SubmitError::Invalid)?;
        let parsed: TaskRequest = serde_json::from_value(request.clone()).map_err(|e| {
            SubmitError::Invalid(vec![Violation {
                field: String::new(),
                message: e.to_string(),
            }])
        })?;
        if let Some(entry) = catalog.get(&parsed.model) {
            validate(RecordKind::request_of(entry.kind), request).map_err(SubmitError::Invalid)?;
        }
        let (model, generation) = catalog
            .normalize(parsed, || fastrand::u64(0..=MAX_SEED))
            .map_err(SubmitError::Invalid)?;
        let record = TaskRecord {
            version: SCHEMA_VERSION,
            task_id: Uuid::now_v7(),
            submitted_at: Utc::now(),
            tenant: submitter.tenant.clone(),
            user: submitter.user.clone(),
            model,
            request: generation,
        };
        let value = serde_json::to_value(&record).expect("record serializes");
        validate(RecordKind::Task, &value).map_err(SubmitError::Invalid)?;
        Ok(record)
    }

    /// Publishes a record and waits for the broker's acknowledgement, at most `timeout`.
    pub async fn publish(&self, record: &TaskRecord, timeout: Duration) -> Result<(), SubmitError> {
        let payload = serde_json::to_vec(record).expect("record serializes");
        let key = record.task_id.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: HEADER_SCHEMA_VERSION,
                value: Some(SCHEMA_VERSION.to_string().as_bytes()),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json".as_bytes()),
            });
        let started = Instant::now();
        let send = self
            .producer
            .send(FutureRecord::to(&self.topic).key(&key).payload(&payload).headers(headers), timeout);
        match tokio::time::timeout(timeout + Duration::from_millis(500), send).await {
            Ok(Ok(_)) => {
                self.metrics.publish_seconds.observe(started.elapsed().as_secs_f64());
                self.metrics.published.with_label_values(&[&record.model]).inc();
                Ok(())
            }
            Ok(Err((e, _))) => Err(SubmitError::Unavailable(e.to_string())),
            Err(_) => Err(SubmitError::Unavailable(format!("no acknowledgement within {timeout:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn submitter() -> Submitter {
        Submitter {
            tenant: "acme".into(),
            user: Some("ann".into()),
        }
    }

    #[test]
    fn a_minimal_request_becomes_an_explicit_record() {
        let record = TaskPublisher::record(
            &Catalog::default(),
            &json!({"model": "terrain", "params": {"difficulty": 7}}),
            &submitter(),
        )
        .unwrap();
        assert_eq!(record.tenant, "acme");
        assert_eq!(record.request.width, 128);
        assert_eq!(record.request.params["difficulty"], 7);
        assert!(record.request.seed <= MAX_SEED);
        assert_eq!(record.task_id.get_version_num(), 7, "time-ordered ids");
    }

    #[test]
    fn the_given_seed_is_kept() {
        let record = TaskPublisher::record(&Catalog::default(), &json!({"model": "terrain", "seed": 99}), &submitter()).unwrap();
        assert_eq!(record.request.seed, 99);
    }

    #[test]
    fn invalid_requests_name_their_fields() {
        match TaskPublisher::record(
            &Catalog::default(),
            &json!({"model": "terrain", "width": 5, "params": {"difficulty": 500}}),
            &submitter(),
        ) {
            Err(SubmitError::Invalid(v)) => {
                let fields: Vec<_> = v.iter().map(|v| v.field.as_str()).collect();
                assert_eq!(fields, vec!["params.difficulty", "width"]);
            }
            other => panic!("{other:?}"),
        }
    }
}
