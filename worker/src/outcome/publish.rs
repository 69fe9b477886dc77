//! Publishing completion events and DLQ records. At least once, a task's offset is acknowledged
//! only after the broker has acknowledged its record (acks=all, idempotent producer); exactly
//! once, its records are held in the [`Outbox`] for the transaction that commits its offset.

use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_schemas::{CompletionEvent, DlqRecord, HEADER_SCHEMA_VERSION, OriginalRecord, SCHEMA_VERSION, dlq_headers};
use sluice_service::kafka;
use sluice_service::kafka_failure;
use thiserror::Error;
use uuid::Uuid;

use crate::outcome::failure::Failure;
use crate::retry::Retriable;
use crate::source::commit::{OutRecord, Outbox};
use crate::source::record::{Origin, Record};

/// Display names the error's class by the shared Kafka policy ([`kafka_failure::classify`]).
#[derive(Debug, Error)]
#[error("publishing to {topic} failed ({}): {source}", kafka_failure::classify(source))]
pub(crate) struct PublishError {
    pub topic: String,
    #[source]
    pub source: KafkaError,
}

/// Broker errors of every class are retried until the worker gives up on its work (shutdown): a
/// task's offset is never committed without its record, so giving up on a publish would lose the
/// task. A class that cannot succeed (a refused or fenced producer) leaves the task unfinished,
/// to run again under the next owner or after a fix, never announced as lost.
impl Retriable for PublishError {
    fn is_retriable(&self) -> bool {
        true
    }
}

/// Where outcomes are announced: the completion and DLQ topics. A trait so that the pipeline's
/// ordering can be unit-tested in process.
/// The trace context a task's outcome records carry: the worker's span of the task (a child of
/// the task record's `traceparent`, its id derived from the record's place so that every outcome
/// record and the exported span agree), and the `tracestate` unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceHeaders {
    pub context: sluice_service::trace::TraceContext,
    /// The span of the task record (the producer's).
    pub parent: [u8; 8],
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// The worker's span of a record, from its receipt to its announced outcome, exported over
    /// OTLP (OpenTelemetry's messaging conventions for a Kafka consumer).
    pub(crate) fn export_span(&self, record: &Record, group: &str, worker_id: &str, event: Option<&CompletionEvent>, error: Option<&str>) {
        use sluice_service::otlp::{KafkaOperation, Span};
        let o = &record.origin;
        let now = std::time::SystemTime::now();
        let start = now.checked_sub(record.received_at.elapsed()).unwrap_or(now);
        let key = record.key.as_deref().and_then(|k| std::str::from_utf8(k).ok());
        let mut span = Span::kafka(KafkaOperation::Process, &o.topic, self.context, Some(self.parent), start)
            .message(key, Some((o.partition, o.offset)))
            .failed(error.map(str::to_owned))
            .attr("messaging.consumer.group.name", group.to_owned())
            .attr("sluice.worker.id", worker_id.to_owned());
        if let Some(event) = event {
            span = span
                .attr("sluice.task.id", event.task_id.to_string())
                .attr("sluice.model", event.model.clone())
                .attr("sluice.task.status", event.status.as_str());
        }
        sluice_service::otlp::record(span);
    }

    /// From a task record's headers; `None` when it carries no valid `traceparent`.
    pub(crate) fn of(record: &Record) -> Option<TraceHeaders> {
        use sluice_service::trace::{TRACEPARENT, TRACESTATE, TraceContext};
        let parent = std::str::from_utf8(record.header(TRACEPARENT)?)
            .ok()
            .and_then(TraceContext::parse)?;
        let o = &record.origin;
        let context = parent.derived(format!("{}/{}/{}/{}", o.topic, o.partition, o.offset, record.attempt()).as_bytes());
        Some(TraceHeaders {
            context,
            parent: parent.span_id,
            traceparent: context.header(),
            tracestate: record
                .header(TRACESTATE)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(sluice_service::trace::bounded_tracestate),
        })
    }

    /// The trace id, for logs.
    pub(crate) fn trace_id(&self) -> &str {
        self.traceparent.get(3..35).unwrap_or_default()
    }

    /// The trace's headers (`traceparent`, and `tracestate` where there is one), for
    /// [`kafka::headers`].
    pub(crate) fn pairs(&self) -> impl Iterator<Item = (&'static str, Option<&[u8]>)> {
        [(sluice_service::trace::TRACEPARENT, Some(self.traceparent.as_bytes()))]
            .into_iter()
            .chain(
                self.tracestate
                    .as_deref()
                    .map(|v| (sluice_service::trace::TRACESTATE, Some(v.as_bytes()))),
            )
    }
}

pub(crate) trait Publish: Send + Sync {
    /// Publishes the completion event of the record at `origin`, keyed by its task id, and waits
    /// for the acknowledgement.
    fn completion<'a>(
        &'a self,
        origin: &'a Origin,
        event: &'a CompletionEvent,
        trace: Option<&'a TraceHeaders>,
    ) -> BoxFuture<'a, Result<(), PublishError>>;
    /// Publishes the DLQ record of `record` and waits for the acknowledgement.
    fn dead_letter<'a>(
        &'a self,
        record: &'a Record,
        failure: &'a Failure,
        task_id: Option<Uuid>,
    ) -> BoxFuture<'a, Result<(), PublishError>>;
}

/// Where the publisher's records go.
#[derive(Clone)]
pub(crate) enum Destination {
    /// Sent at once (acks=all, idempotent producer).
    Broker(FutureProducer),
    /// Held for the transaction that commits the record's offset.
    Outbox(std::sync::Arc<Outbox>),
}

/// The Kafka publisher.
#[derive(Clone)]
pub(crate) struct Publisher {
    destination: Destination,
    completions_topic: String,
    dlq_topic: String,
    worker_id: String,
    /// How long one send may wait in the producer's queue.
    queue_timeout: Duration,
}

impl Publisher {
    pub(crate) fn new(destination: Destination, completions_topic: String, dlq_topic: String, worker_id: String) -> Publisher {
        Publisher {
            destination,
            completions_topic,
            dlq_topic,
            worker_id,
            queue_timeout: Duration::from_secs(5),
        }
    }

    async fn send(
        &self,
        origin: &Origin,
        topic: &str,
        key: Option<&[u8]>,
        payload: Vec<u8>,
        headers: OwnedHeaders,
    ) -> Result<(), PublishError> {
        let producer = match &self.destination {
            Destination::Broker(producer) => producer,
            Destination::Outbox(outbox) => {
                let record = OutRecord {
                    topic: topic.to_owned(),
                    key: key.map(<[u8]>::to_vec),
                    payload,
                    headers,
                };
                outbox.push(origin, record);
                return Ok(());
            }
        };
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(&payload).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        producer
            .send(record, self.queue_timeout)
            .await
            .map(|_| ())
            .map_err(|(source, _)| PublishError {
                topic: topic.to_owned(),
                source,
            })
    }

    async fn publish_completion(&self, origin: &Origin, event: &CompletionEvent, trace: Option<&TraceHeaders>) -> Result<(), PublishError> {
        let payload = serde_json::to_vec(event).expect("completion serializes");
        let key = event.task_id.to_string();
        let version = SCHEMA_VERSION.to_string();
        let headers = kafka::headers(
            [
                (HEADER_SCHEMA_VERSION, Some(version.as_bytes())),
                (kafka::CONTENT_TYPE, Some(kafka::JSON)),
            ]
            .into_iter()
            .chain(trace.into_iter().flat_map(TraceHeaders::pairs)),
        );
        self.send(origin, &self.completions_topic, Some(key.as_bytes()), payload, headers)
            .await
    }

    /// Publishes a DLQ record: the original key unchanged, the original value and headers kept
    /// byte for byte inside the record, and the failure as fields and as `sluice-dlq-*` headers.
    async fn publish_dead_letter(&self, record: &Record, failure: &Failure, task_id: Option<Uuid>) -> Result<(), PublishError> {
        let now = chrono::Utc::now();
        let dlq = DlqRecord {
            version: SCHEMA_VERSION,
            reason: failure.reason,
            message: failure.message.clone(),
            attempts: failure.attempts,
            task_id,
            source: record.origin.source_ref(),
            first_failed_at: failure.first_failed_at,
            last_failed_at: now,
            worker_id: self.worker_id.clone(),
            details: failure.details.clone(),
            original: OriginalRecord::new(record.key.as_deref(), &record.value, &record.headers, record.timestamp_ms),
        };
        let payload = serde_json::to_vec(&dlq).expect("DLQ record serializes");
        let partition = record.origin.partition.to_string();
        let offset = record.origin.offset.to_string();
        let attempts = failure.attempts.to_string();
        let version = SCHEMA_VERSION.to_string();
        let first = failure.first_failed_at.to_rfc3339();
        let last = now.to_rfc3339();
        // Header values must stay small; the full message is in the record.
        let message: String = failure.message.chars().take(1000).collect();
        let headers = [
            (dlq_headers::REASON, failure.reason.as_str()),
            (dlq_headers::MESSAGE, message.as_str()),
            (dlq_headers::ATTEMPTS, attempts.as_str()),
            (dlq_headers::SOURCE_TOPIC, &record.origin.topic),
            (dlq_headers::SOURCE_PARTITION, partition.as_str()),
            (dlq_headers::SOURCE_OFFSET, offset.as_str()),
            (dlq_headers::FIRST_FAILED_AT, first.as_str()),
            (dlq_headers::LAST_FAILED_AT, last.as_str()),
            (HEADER_SCHEMA_VERSION, version.as_str()),
        ];
        // The trace continues on the DLQ record (the original's own headers stay inside it).
        let trace = TraceHeaders::of(record);
        let headers = kafka::headers(
            headers
                .map(|(key, value)| (key, Some(value.as_bytes())))
                .into_iter()
                .chain(trace.iter().flat_map(TraceHeaders::pairs)),
        );
        self.send(&record.origin, &self.dlq_topic, record.key.as_deref(), payload, headers)
            .await
    }
}

impl Publish for Publisher {
    fn completion<'a>(
        &'a self,
        origin: &'a Origin,
        event: &'a CompletionEvent,
        trace: Option<&'a TraceHeaders>,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(self.publish_completion(origin, event, trace))
    }

    fn dead_letter<'a>(
        &'a self,
        record: &'a Record,
        failure: &'a Failure,
        task_id: Option<Uuid>,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(self.publish_dead_letter(record, failure, task_id))
    }
}
