//! Turning a task request into a versioned task record and publishing it.

use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use serde_json::Value;
use sluice_schemas::normalize::MAX_SEED;
use sluice_schemas::topics::TaskTopics;
use sluice_schemas::{
    Catalog, HEADER_SCHEMA_VERSION, Idempotency, RecordKind, SCHEMA_VERSION, TaskRecord, TaskRequest, Violation, validate,
};
use sluice_service::kafka;
use sluice_service::kafka_failure;
use thiserror::Error;
use uuid::Uuid;

use crate::config::PublishArgs;
use crate::events::{Emit, TaskPublished};
use crate::metrics::Metrics;

#[derive(Debug, Error)]
pub enum SubmitError {
    /// The request is invalid; each violation names its field.
    #[error("invalid request: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Violation>),
    /// The broker refused the record or could not take it (the message names which, by the
    /// shared Kafka policy). Nothing was accepted.
    #[error("the task could not be queued ({}): {source}", kafka_failure::classify(source))]
    Unavailable { source: KafkaError },
    /// The broker did not acknowledge the record in time. Nothing was accepted.
    #[error("the task could not be queued: no acknowledgement within {0:?}")]
    NotAcknowledged(Duration),
}

/// The task id of a tenant's idempotency key: the same on every replica and after restarts, so
/// that even a race between replicas publishes one task id (UUID version 8, from SHA-256).
pub fn idempotent_task_id(tenant: &str, key: &str) -> Uuid {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("sluice-idempotency\0{tenant}\0{key}").as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// SHA-256 (hex) of a request as parsed: object keys sorted, no insignificant spaces, so that
/// the same JSON sent with other formatting is the same request.
pub fn request_sha256(request: &Value) -> String {
    use sha2::Digest;
    let canonical = serde_json::to_vec(request).expect("JSON serializes");
    sha2::Sha256::digest(&canonical).iter().map(|b| format!("{b:02x}")).collect()
}

/// The record's deadline from `deadline` or `ttl_seconds`: in the future, at most `max_ttl`
/// ahead (the model's `max_ttl_seconds` in the catalog).
fn deadline_of(
    request: &TaskRequest,
    now: chrono::DateTime<Utc>,
    max_ttl: chrono::TimeDelta,
) -> Result<Option<chrono::DateTime<Utc>>, (&'static str, String)> {
    let most = || format!("at most {} seconds ahead for model {}", max_ttl.num_seconds(), request.model);
    match (request.deadline, request.ttl_seconds) {
        (Some(_), Some(_)) => Err(("deadline", "give deadline or ttl_seconds, not both".into())),
        (Some(d), None) if d <= now => Err(("deadline", format!("{d} is not in the future"))),
        (Some(d), None) if d - now > max_ttl => Err(("deadline", most())),
        (Some(d), None) => Ok(Some(d)),
        (None, Some(ttl)) if ttl as i64 > max_ttl.num_seconds() => Err(("ttl_seconds", most())),
        (None, Some(ttl)) => Ok(Some(now + chrono::TimeDelta::seconds(ttl as i64))),
        (None, None) => Ok(None),
    }
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
    topics: TaskTopics,
    metrics: Metrics,
}

impl TaskPublisher {
    pub fn new(producer: FutureProducer, topics: TaskTopics, metrics: Metrics) -> TaskPublisher {
        TaskPublisher { producer, topics, metrics }
    }

    /// A publisher to the task topics of `args` (a task to its lane's), on a Kafka producer of its own: client id
    /// `sluice-producer`, a delivery given up after the publish timeout, 5 ms linger.
    pub fn connect(args: &PublishArgs, metrics: &Metrics) -> Result<TaskPublisher, KafkaError> {
        let producer: FutureProducer = args.kafka.producer_config("sluice-producer", args.publish_timeout_ms, 5).create()?;
        Ok(TaskPublisher::new(producer, args.task_topics(), metrics.clone()))
    }

    /// Checks that the cluster has every task topic (a setup mistake otherwise): one metadata
    /// request ([`kafka::check_topics`]). Blocks.
    pub fn check_topics(&self) -> Result<(), sluice_service::kafka::MissingTopics> {
        kafka::check_topics(self.producer.client(), &self.topics.all())
    }

    /// Builds the record of a request: validated against `task-request.schema.json` and the
    /// model's catalog entry, every default filled in (a seed drawn if none was given), then
    /// checked as a task record too. Input images are stored by the HTTP API only: a request
    /// with one is refused here.
    pub fn record(catalog: &Catalog, request: &Value, submitter: &Submitter) -> Result<TaskRecord, SubmitError> {
        if request.get("init_image").is_some() {
            return Err(SubmitError::Invalid(vec![Violation {
                field: "init_image".into(),
                message: "input images are taken by POST /v1/tasks only".into(),
            }]));
        }
        Self::record_with_key(catalog, request, submitter, None)
    }

    /// [`TaskPublisher::record`] with the client's `Idempotency-Key`: the task id is derived
    /// from the tenant and the key, and the record carries the request's hash.
    pub fn record_with_key(
        catalog: &Catalog,
        request: &Value,
        submitter: &Submitter,
        key: Option<&str>,
    ) -> Result<TaskRecord, SubmitError> {
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
        let now = Utc::now();
        let max_ttl = catalog
            .get(&parsed.model)
            .map_or(sluice_schemas::catalog::DEFAULT_MAX_TTL_SECONDS, |m| m.max_ttl_seconds);
        let deadline =
            deadline_of(&parsed, now, chrono::TimeDelta::seconds(max_ttl.min(i64::MAX as u64) as i64)).map_err(|(field, message)| {
                SubmitError::Invalid(vec![Violation {
                    field: field.into(),
                    message,
                }])
            })?;
        let webhook = parsed.webhook.clone();
        let priority = parsed.priority.unwrap_or_default();
        let (model, generation) = catalog
            .normalize(parsed, || fastrand::u64(0..=MAX_SEED))
            .map_err(SubmitError::Invalid)?;
        let record = TaskRecord {
            version: SCHEMA_VERSION,
            task_id: key.map_or_else(Uuid::now_v7, |k| idempotent_task_id(&submitter.tenant, k)),
            submitted_at: now,
            tenant: submitter.tenant.clone(),
            user: submitter.user.clone(),
            model,
            request: generation,
            idempotency: key.map(|k| Idempotency {
                key: k.to_owned(),
                request_sha256: request_sha256(request),
            }),
            deadline,
            priority,
            webhook,
        };
        // An image task is checked as it will be published, once its images are stored and
        // referenced (crate::input_images): the references stand in here.
        let mut value = serde_json::to_value(&record).expect("record serializes");
        if record.request.strength.is_some() {
            let placeholder = serde_json::to_value(sluice_schemas::ImageRef::of_sha256("0".repeat(64))).expect("serializes");
            value["request"]["init_image"] = placeholder.clone();
            if request.get("mask_image").is_some() {
                value["request"]["mask_image"] = placeholder;
            }
        }
        validate(RecordKind::Task, &value).map_err(SubmitError::Invalid)?;
        Ok(record)
    }

    /// Publishes a control record (a cancel) to `topic`, keyed by task id, and waits for the
    /// broker's acknowledgement, at most `timeout`.
    pub async fn publish_control(&self, topic: &str, record: &sluice_schemas::ControlRecord, timeout: Duration) -> Result<(), SubmitError> {
        let payload = serde_json::to_vec(record).expect("record serializes");
        let key = record.task_id.to_string();
        let version = SCHEMA_VERSION.to_string();
        let headers = kafka::headers([(HEADER_SCHEMA_VERSION, Some(version.as_bytes()))]);
        self.send_acked(topic, &key, &payload, headers, timeout).await.map(|_| ())
    }

    /// Sends one record and waits for the broker's acknowledgement, at most `timeout`.
    async fn send_acked(
        &self,
        topic: &str,
        key: &str,
        payload: &[u8],
        headers: OwnedHeaders,
        timeout: Duration,
    ) -> Result<(i32, i64), SubmitError> {
        let send = self
            .producer
            .send(FutureRecord::to(topic).key(key).payload(payload).headers(headers), timeout);
        match tokio::time::timeout(timeout + Duration::from_millis(500), send).await {
            Ok(Ok(delivery)) => Ok((delivery.partition, delivery.offset)),
            Ok(Err((source, _))) => Err(SubmitError::Unavailable { source }),
            Err(_) => Err(SubmitError::NotAcknowledged(timeout)),
        }
    }

    /// Publishes a record and waits for the broker's acknowledgement, at most `timeout`.
    pub async fn publish(&self, record: &TaskRecord, timeout: Duration) -> Result<(), SubmitError> {
        self.publish_traced(record, None, None, timeout).await
    }

    /// [`TaskPublisher::publish`] with the request's trace context as `traceparent` (and
    /// `tracestate`) record headers: the producer's span (exported over OTLP when that is on) and
    /// the request's span it continues, if any.
    pub async fn publish_traced(
        &self,
        record: &TaskRecord,
        trace: Option<(&sluice_service::trace::TraceContext, Option<[u8; 8]>)>,
        tracestate: Option<&str>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        let payload = serde_json::to_vec(record).expect("record serializes");
        let key = record.task_id.to_string();
        let version = SCHEMA_VERSION.to_string();
        let traceparent = trace.map(|(t, _)| t.header());
        let headers = kafka::headers(
            [
                (HEADER_SCHEMA_VERSION, Some(version.as_bytes())),
                (kafka::CONTENT_TYPE, Some(kafka::JSON)),
            ]
            .into_iter()
            .chain(
                traceparent
                    .as_deref()
                    .map(|v| (sluice_service::trace::TRACEPARENT, Some(v.as_bytes()))),
            )
            .chain(tracestate.map(|v| (sluice_service::trace::TRACESTATE, Some(v.as_bytes())))),
        );
        let started = Instant::now();
        let wall_start = std::time::SystemTime::now();
        let topic = self.topics.of(record.priority);
        let sent = self.send_acked(topic, &key, &payload, headers, timeout).await;
        if let Some((context, parent)) = trace {
            use sluice_service::otlp::{KafkaOperation, Span};
            let span = Span::kafka(KafkaOperation::Send, topic, *context, parent, wall_start)
                .message(Some(key.as_str()), sent.as_ref().ok().copied())
                .failed(sent.as_ref().err().map(|e| e.to_string()))
                .attr("sluice.task.id", key.clone())
                .attr("sluice.model", record.model.clone());
            sluice_service::otlp::record(span);
        }
        sent?;
        TaskPublished {
            model: &record.model,
            elapsed: started.elapsed(),
        }
        .emit(&self.metrics);
        Ok(())
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

    #[test]
    fn an_idempotency_key_fixes_the_task_id_per_tenant_and_the_hash_ignores_formatting() {
        let a: Value = serde_json::from_str(r#"{"model": "terrain", "seed": 5, "params": {"difficulty": 7, "colormap": "grey"}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"params":{"colormap":"grey","difficulty":7},"seed":5,"model":"terrain"}"#).unwrap();
        assert_eq!(request_sha256(&a), request_sha256(&b));
        assert_ne!(request_sha256(&a), request_sha256(&json!({"model": "terrain", "seed": 6})));
        assert_eq!(idempotent_task_id("acme", "k1"), idempotent_task_id("acme", "k1"));
        assert_ne!(idempotent_task_id("acme", "k1"), idempotent_task_id("rival", "k1"));
        assert_ne!(idempotent_task_id("acme", "k1"), idempotent_task_id("acme", "k2"));
        let record = TaskPublisher::record_with_key(&Catalog::default(), &a, &submitter(), Some("k1")).unwrap();
        assert_eq!(record.task_id, idempotent_task_id("acme", "k1"));
        assert_eq!(record.idempotency.as_ref().unwrap().request_sha256, request_sha256(&a));
        let value = serde_json::to_value(&record).unwrap();
        assert!(
            sluice_schemas::validate(RecordKind::Task, &value).is_ok(),
            "the record with its key is a valid task record"
        );
    }

    #[test]
    fn deadlines_are_bounded_by_the_models_maximum() {
        let catalog = Catalog::parse("[[model]]\nname = \"terrain\"\nkind = \"terrain\"\nmax_ttl_seconds = 3600\n").unwrap();
        let ok = TaskPublisher::record(&catalog, &json!({"model": "terrain", "ttl_seconds": 3600}), &submitter()).unwrap();
        assert!(ok.deadline.is_some());
        for (request, field) in [
            (json!({"model": "terrain", "ttl_seconds": 3601}), "ttl_seconds"),
            (
                json!({"model": "terrain", "deadline": (Utc::now() + chrono::TimeDelta::hours(2)).to_rfc3339()}),
                "deadline",
            ),
        ] {
            match TaskPublisher::record(&catalog, &request, &submitter()) {
                Err(SubmitError::Invalid(v)) => assert_eq!(v[0].field, field, "{v:?}"),
                other => panic!("{request} should be refused: {other:?}"),
            }
        }
        let default = TaskPublisher::record(
            &Catalog::default(),
            &json!({"model": "terrain", "ttl_seconds": 86_400}),
            &submitter(),
        );
        assert!(default.is_ok(), "30 days by default");
    }
}
