//! Internal events: one struct per thing that happens, which records it in the metrics and, where
//! it is worth a line, logs it at the right level. Events carry plain data (ids, names, times),
//! never the producer's own types.
//!
//! The rule: `metrics.rs` registers every metric and `events.rs` writes them — no other module
//! touches a metric. Counters and histograms count what happened; gauges mirror state and are set
//! by the event that reports the state.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sluice_schemas::{WebhookEvent, WebhookFailure};
use uuid::Uuid;

use crate::metrics::Metrics;

pub(crate) trait Emit {
    fn emit(self, metrics: &Metrics);
}

/// How long ago `at` was (nothing for a time in the future).
fn age(at: DateTime<Utc>) -> Duration {
    (Utc::now() - at).to_std().unwrap_or_default()
}

/// A task request was answered, with this HTTP status.
pub(crate) struct RequestAnswered {
    pub status: u16,
}

impl Emit for RequestAnswered {
    fn emit(self, m: &Metrics) {
        m.requests.with_label_values(&[&self.status.to_string()]).inc();
    }
}

/// The broker acknowledged a task record, `elapsed` after it was sent.
pub(crate) struct TaskPublished<'a> {
    pub model: &'a str,
    pub elapsed: Duration,
}

impl Emit for TaskPublished<'_> {
    fn emit(self, m: &Metrics) {
        m.publish_seconds.observe(self.elapsed.as_secs_f64());
        m.published.with_label_values(&[self.model]).inc();
    }
}

/// The status view read a record of one of its topics, whose own time (submitted, progress,
/// completed) is `at`: its lag is how long the record waited to be applied.
pub(crate) struct ViewRecordRead {
    pub at: DateTime<Utc>,
}

impl Emit for ViewRecordRead {
    fn emit(self, m: &Metrics) {
        m.view_lag_seconds.observe(age(self.at).as_secs_f64());
    }
}

/// One partition's backlog as measured: the tasks the workers' group has not committed, and how
/// long the oldest of them has waited (`None`: none waiting).
pub(crate) struct BacklogMeasured<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub tasks: i64,
    pub oldest_seconds: Option<f64>,
}

impl Emit for BacklogMeasured<'_> {
    fn emit(self, m: &Metrics) {
        let labels = [self.topic, &self.partition.to_string()];
        m.backlog_tasks.with_label_values(&labels).set(self.tasks);
        m.backlog_oldest_seconds
            .with_label_values(&labels)
            .set(self.oldest_seconds.unwrap_or(0.0));
    }
}

/// The webhook notifier holds this many records it consumed and has not finished.
pub(crate) struct WebhookPending {
    pub records: usize,
}

impl Emit for WebhookPending {
    fn emit(self, m: &Metrics) {
        m.webhook_pending.set(self.records as i64);
    }
}

/// A webhook event not sent, and not to be: `outcome` says why (throttled, superseded, or how a
/// `started` or `progress` attempt was given up).
pub(crate) struct WebhookNotSent {
    pub event: WebhookEvent,
    pub outcome: &'static str,
}

impl Emit for WebhookNotSent {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries.with_label_values(&[self.event.as_str(), self.outcome]).inc();
    }
}

/// A task's event goes to its first attempt; `at` is when it happened (its record's time).
pub(crate) struct WebhookFirstAttempt {
    pub at: DateTime<Utc>,
}

impl Emit for WebhookFirstAttempt {
    fn emit(self, m: &Metrics) {
        m.webhook_event_age_seconds.observe(age(self.at).as_secs_f64());
    }
}

/// A retry of a webhook event is due and goes to its attempt.
pub(crate) struct WebhookRetryDue;

impl Emit for WebhookRetryDue {
    fn emit(self, m: &Metrics) {
        m.webhook_retries.inc();
    }
}

/// One webhook attempt took `elapsed`, whatever came of it.
pub(crate) struct WebhookAttempted {
    pub event: WebhookEvent,
    pub elapsed: Duration,
}

impl Emit for WebhookAttempted {
    fn emit(self, m: &Metrics) {
        m.webhook_attempt_seconds
            .with_label_values(&[self.event.as_str()])
            .observe(self.elapsed.as_secs_f64());
    }
}

/// The receiver accepted a webhook, answering `status`.
pub(crate) struct WebhookDelivered<'a> {
    pub event: WebhookEvent,
    pub event_id: &'a str,
    pub task_id: Uuid,
    pub status: u16,
    pub attempt: u32,
}

impl Emit for WebhookDelivered<'_> {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries.with_label_values(&[self.event.as_str(), "delivered"]).inc();
        tracing::debug!(event_id = %self.event_id, task_id = %self.task_id, status = self.status, attempt = self.attempt, "webhook delivered");
    }
}

/// A `completed` webhook attempt failed and is retried after `delay`.
pub(crate) struct WebhookRetrying<'a> {
    pub event: WebhookEvent,
    pub event_id: &'a str,
    pub task_id: Uuid,
    pub attempt: u32,
    pub error: &'a str,
    pub delay: Duration,
}

impl Emit for WebhookRetrying<'_> {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries.with_label_values(&[self.event.as_str(), "retrying"]).inc();
        tracing::info!(event_id = %self.event_id, task_id = %self.task_id, attempt = self.attempt, error = %self.error, delay = ?self.delay, "webhook attempt failed; retrying later");
    }
}

/// A `started` or `progress` webhook attempt failed; such events are not retried.
pub(crate) struct WebhookDropped<'a> {
    pub event: WebhookEvent,
    pub event_id: &'a str,
    pub error: &'a str,
}

impl Emit for WebhookDropped<'_> {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries.with_label_values(&[self.event.as_str(), "dropped"]).inc();
        tracing::debug!(event_id = %self.event_id, error = %self.error, "webhook {} event not delivered (not retried)", self.event.as_str());
    }
}

/// A webhook attempt past its tenant's or host's share of the attempts in flight.
pub(crate) struct WebhookDeferred<'a> {
    pub event: WebhookEvent,
    pub event_id: &'a str,
    pub task_id: Uuid,
    pub why: &'a str,
}

impl Emit for WebhookDeferred<'_> {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries.with_label_values(&[self.event.as_str(), "deferred"]).inc();
        tracing::debug!(event_id = %self.event_id, task_id = %self.task_id, why = %self.why, "webhook attempt deferred");
    }
}

/// A `completed` webhook given up: it goes to the webhook DLQ.
pub(crate) struct WebhookGivenUp<'a> {
    pub event: WebhookEvent,
    pub event_id: &'a str,
    pub task_id: Uuid,
    pub host: &'a str,
    pub reason: WebhookFailure,
    pub error: &'a str,
}

impl Emit for WebhookGivenUp<'_> {
    fn emit(self, m: &Metrics) {
        m.webhook_deliveries
            .with_label_values(&[self.event.as_str(), self.reason.as_str()])
            .inc();
        tracing::warn!(event_id = %self.event_id, task_id = %self.task_id, host = %self.host, reason = self.reason.as_str(), error = %self.error, "webhook given up");
    }
}
