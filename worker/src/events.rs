//! Internal events: one struct per thing that happens, which logs it once at the right level and
//! counts it. Stages emit these instead of scattering log lines and metric names.

use std::time::Duration;

use sluice_schemas::DlqReason;

use crate::adaptive::BatchItem;
use crate::engine::EngineError;
use crate::metrics::Metrics;
use crate::models::Bucket;

pub trait Emit {
    fn emit(self, metrics: &Metrics);
}

/// A model call finished.
pub struct BatchRan<'a> {
    pub bucket: &'a Bucket,
    pub size: usize,
    pub elapsed: Duration,
}

impl Emit for BatchRan<'_> {
    fn emit(self, m: &Metrics) {
        let bucket = self.bucket.to_string();
        m.batches.with_label_values(&[&bucket]).inc();
        m.batch_size.with_label_values(&[&bucket]).observe(self.size as f64);
        m.inference_seconds
            .with_label_values(&[&self.bucket.model])
            .observe(self.elapsed.as_secs_f64());
        tracing::debug!(%bucket, size = self.size, ms = self.elapsed.as_millis() as u64, "batch ran");
    }
}

/// A batch ran out of memory and will run again smaller. A WARN, never an ERROR: it is handled.
pub struct OomHandled<'a, T> {
    pub bucket: &'a Bucket,
    pub from: usize,
    pub to: usize,
    pub items: &'a [T],
    pub error: &'a EngineError,
}

impl<T: BatchItem> Emit for OomHandled<'_, T> {
    fn emit(self, m: &Metrics) {
        let bucket = self.bucket.to_string();
        m.ooms.with_label_values(&[&bucket]).inc();
        let task_ids: Vec<String> = self.items.iter().map(BatchItem::id).collect();
        let dimensions: Vec<String> = self.items.iter().map(BatchItem::dimensions).collect();
        tracing::warn!(
            %bucket,
            batch_before = self.from,
            batch_after = self.to,
            rows = self.from * self.bucket.rows_per_task,
            dimensions = %dimensions.join(","),
            task_ids = %task_ids.join(","),
            error = %short(self.error),
            "out of memory; retrying with a smaller batch"
        );
    }
}

/// A task ran out of memory alone, with the device to itself: it goes to the DLQ.
pub struct DoesNotFit<'a, T> {
    pub bucket: &'a Bucket,
    pub item: &'a T,
    pub error: &'a EngineError,
}

impl<T: BatchItem> Emit for DoesNotFit<'_, T> {
    fn emit(self, m: &Metrics) {
        m.ooms.with_label_values(&[&self.bucket.to_string()]).inc();
        tracing::warn!(
            bucket = %self.bucket,
            task_id = %self.item.id(),
            dimensions = %self.item.dimensions(),
            rows = self.bucket.rows_per_task,
            error = %short(self.error),
            "out of memory at batch 1; the task does not fit and goes to the DLQ"
        );
    }
}

/// The learned ceiling of a bucket went up by one, to test whether more fits again.
pub struct CeilingProbed<'a> {
    pub bucket: &'a Bucket,
    pub to: usize,
}

impl Emit for CeilingProbed<'_> {
    fn emit(self, _: &Metrics) {
        tracing::info!(bucket = %self.bucket, batch = self.to, "probing a larger batch");
    }
}

/// A record went to the DLQ (its DLQ record was acknowledged).
pub struct DeadLettered<'a> {
    pub reason: DlqReason,
    pub task_id: Option<String>,
    pub message: &'a str,
    pub partition: i32,
    pub offset: i64,
}

impl Emit for DeadLettered<'_> {
    fn emit(self, m: &Metrics) {
        m.dlq_records.with_label_values(&[self.reason.as_str()]).inc();
        m.tasks_finished.with_label_values(&["failed"]).inc();
        tracing::warn!(
            reason = %self.reason,
            task_id = self.task_id.as_deref().unwrap_or("-"),
            partition = self.partition,
            offset = self.offset,
            message = %truncate(self.message, 500),
            "record sent to the DLQ"
        );
    }
}

/// A task succeeded (its completion was acknowledged).
pub struct TaskSucceeded<'a> {
    pub task_id: &'a str,
    pub images: usize,
    pub total: Duration,
    pub upload: Duration,
    pub duplicate: bool,
}

impl Emit for TaskSucceeded<'_> {
    fn emit(self, m: &Metrics) {
        m.tasks_finished.with_label_values(&["succeeded"]).inc();
        m.task_seconds.observe(self.total.as_secs_f64());
        if self.duplicate {
            m.duplicates_skipped.inc();
        } else {
            m.upload_seconds.observe(self.upload.as_secs_f64());
        }
        tracing::debug!(
            task_id = self.task_id,
            images = self.images,
            duplicate = self.duplicate,
            ms = self.total.as_millis() as u64,
            "task succeeded"
        );
    }
}

/// A transient failure will be retried after `delay`.
pub struct RetryScheduled<'a> {
    pub operation: &'static str,
    pub attempt: u32,
    pub delay: Duration,
    pub error: &'a str,
}

impl Emit for RetryScheduled<'_> {
    fn emit(self, m: &Metrics) {
        m.retries.with_label_values(&[self.operation]).inc();
        tracing::warn!(operation = self.operation, attempt = self.attempt, delay_ms = self.delay.as_millis() as u64, error = %truncate(self.error, 300), "transient failure; retrying");
    }
}

fn short(error: &EngineError) -> String {
    truncate(&error.to_string(), 300)
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
