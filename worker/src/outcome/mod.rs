//! The one owner of a task's outcome. Every task ends here, exactly one way: it succeeded (its
//! completion is published), or it failed (its DLQ record, then — when the task is known — a
//! failed completion). Only after the broker acknowledged those records is the task's offset
//! acknowledged to [`Offsets`]. Adding a way to fail is one call to [`Outcomes::fail`] with a
//! [`Failure`]; nothing else publishes outcomes or acknowledges offsets.
//!
//! A task given up at shutdown (or whose partition was taken away) is never acknowledged: the
//! next owner reads it again.

mod ending;
pub(crate) mod failure;
pub(crate) mod progress;
pub(crate) mod publish;

pub(crate) use ending::{Failed, Success, TaskIdentity};

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sluice_schemas::{CompletionError, CompletionEvent, CompletionStatus, DlqReason, OutputRef, SCHEMA_VERSION, Timings};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::events::{DeadLettered, Emit, TaskEnded, TaskSucceeded};
use crate::metrics::Metrics;
use crate::outcome::failure::Failure;
use crate::outcome::publish::Publish;
use crate::pipeline::task::Job;
use crate::retry::{GaveUp, RetryPolicy, retry};
use crate::source::offsets::Offsets;
use crate::source::record::Record;

/// Publishes outcomes and acknowledges offsets. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Outcomes {
    inner: Arc<OutcomeSettings>,
}

/// What [`Outcomes`] works with.
pub(crate) struct OutcomeSettings {
    pub offsets: Arc<Offsets>,
    pub publisher: Arc<dyn Publish>,
    pub metrics: Metrics,
    pub worker_id: String,
    /// The consumer group (an attribute of the exported spans).
    pub group: String,
    /// Broker retries: until abandoned (the offset is never committed without the record).
    pub retry: RetryPolicy,
    /// Fires when the worker gives up on what is in flight (shutdown grace over, fatal error).
    pub abandon: CancellationToken,
    /// Failures are published in the background; shutdown waits for them here.
    pub tasks: TaskTracker,
}

impl Outcomes {
    pub(crate) fn new(settings: OutcomeSettings) -> Outcomes {
        Outcomes { inner: Arc::new(settings) }
    }

    /// Fails a task or record, in the background: its DLQ record, its failed completion when the
    /// task is known, then its offset.
    pub(crate) fn fail(&self, failed: impl Into<Failed>, failure: Failure) {
        let this = self.clone();
        let failed = failed.into();
        self.inner.tasks.spawn(async move { this.fail_now(failed, failure).await });
    }

    /// Fails a task whose storage operation `doing` was given up: retries exhausted or a
    /// permanent refusal. Cancelled (shutdown) leaves it unacknowledged.
    pub(crate) fn gave_up<E: std::fmt::Display>(&self, job: Job, doing: &str, gave_up: GaveUp<E>) {
        let (reason, error, attempts, first_failed_at) = match gave_up {
            GaveUp::Cancelled => return,
            GaveUp::Exhausted {
                error,
                attempts,
                first_failed_at,
            } => (DlqReason::RetriesExhausted, error, attempts, first_failed_at),
            GaveUp::Permanent { error, attempts } => (DlqReason::StorageRejected, error, attempts, Utc::now()),
        };
        let failure = Failure {
            reason,
            message: format!("{doing}: {error}"),
            details: None,
            attempts,
            first_failed_at,
        };
        self.fail(job, failure);
    }

    async fn fail_now(&self, failed: Failed, failure: Failure) {
        let i = &self.inner;
        let lane = failed.lane();
        let (identity, record) = failed.into_parts();
        let sent = retry(i.retry, "publish_dlq", &i.metrics, &i.abandon, || {
            i.publisher.dead_letter(&record, &failure, identity.task_id)
        })
        .await;
        if sent.is_err() {
            return; // abandoned: not acknowledged, read again after restart
        }
        let task_id = identity.task_id;
        if task_id.is_none()
            && let Some(trace) = crate::outcome::publish::TraceHeaders::of(&record)
        {
            trace.export_span(
                &record,
                &self.inner.group,
                &self.inner.worker_id,
                None,
                Some(failure.message.as_str()),
            );
        }
        if task_id.is_some() {
            let timings = Timings {
                total_ms: record.received_at.elapsed().as_millis() as u64,
                ..Timings::default()
            };
            let error = CompletionError {
                reason: failure.reason,
                message: failure.message.clone(),
            };
            let event = self.completion(identity, &record, CompletionStatus::Failed, Vec::new(), timings, Some(error));
            if !self.publish(&event, &record).await {
                return;
            }
        }
        DeadLettered {
            reason: failure.reason,
            task_id: task_id.map(|t| t.to_string()),
            message: &failure.message,
            partition: record.origin.partition,
            offset: record.origin.offset,
        }
        .emit(&i.metrics);
        i.offsets.ack_in_lane(&record.origin, lane);
    }

    /// A task succeeded: publishes its completion and acknowledges it. Returns false when the
    /// worker gave up first (shutdown): then it stays unacknowledged.
    pub(crate) async fn succeed(&self, job: &Job, success: Success) -> bool {
        let Success {
            outputs,
            timings,
            duplicate,
            upload,
        } = success;
        let task_id = job.task.task_id.to_string();
        let event = self.completion(
            TaskIdentity::of(&job.task),
            &job.record,
            CompletionStatus::Succeeded,
            outputs,
            timings,
            None,
        );
        if !self.publish(&event, &job.record).await {
            return false;
        }
        TaskSucceeded {
            task_id: &task_id,
            lane: job.task.priority,
            images: event.outputs.len(),
            total: Duration::from_millis(timings.total_ms),
            upload,
            duplicate,
        }
        .emit(&self.inner.metrics);
        self.inner.offsets.ack_in_lane(&job.record.origin, job.task.priority);
        true
    }

    /// A task that ends without a result: cancelled by its client (before it ran, or between
    /// steps) or expired (dequeued past its deadline). Its completion says so; no images, no
    /// DLQ record; then its offset.
    pub(crate) async fn ended(&self, job: &Job, status: CompletionStatus) -> bool {
        let timings = Timings {
            total_ms: job.age_ms(Utc::now()),
            ..Timings::default()
        };
        let event = self.completion(TaskIdentity::of(&job.task), &job.record, status, Vec::new(), timings, None);
        if !self.publish(&event, &job.record).await {
            return false;
        }
        TaskEnded {
            task_id: &job.task.task_id.to_string(),
            status,
        }
        .emit(&self.inner.metrics);
        self.inner.offsets.ack_in_lane(&job.record.origin, job.task.priority);
        true
    }

    fn completion(
        &self,
        identity: TaskIdentity,
        record: &Record,
        status: CompletionStatus,
        outputs: Vec<OutputRef>,
        timings: Timings,
        error: Option<CompletionError>,
    ) -> CompletionEvent {
        CompletionEvent {
            version: SCHEMA_VERSION,
            task_id: identity.task_id.expect("a completion is for a known task"),
            status,
            model: identity.model.unwrap_or_default(),
            tenant: identity.tenant.unwrap_or_default(),
            user: identity.user,
            outputs,
            error,
            timings,
            worker_id: self.inner.worker_id.clone(),
            attempt: record.attempt(),
            completed_at: Utc::now(),
            source: record.origin.source_ref(),
        }
    }

    /// Publishes until acknowledged; false when abandoned.
    async fn publish(&self, event: &CompletionEvent, record: &Record) -> bool {
        let i = &self.inner;
        let trace = crate::outcome::publish::TraceHeaders::of(record);
        let sent = retry(i.retry, "publish_completion", &i.metrics, &i.abandon, || {
            i.publisher.completion(&record.origin, event, trace.as_ref())
        })
        .await
        .is_ok();
        if sent && let Some(trace) = &trace {
            trace.export_span(
                record,
                &self.inner.group,
                &self.inner.worker_id,
                Some(event),
                event.error.as_ref().map(|e| e.message.as_str()),
            );
        }
        sent
    }
}
