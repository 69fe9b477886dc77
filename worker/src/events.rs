//! Internal events: one struct per thing that happens, which logs it once at the right level and
//! records it in the metrics. Events carry plain data (ids, sizes, names), never pipeline types.
//!
//! The rule: `metrics.rs` registers every metric and `events.rs` writes them — no other module
//! touches a metric. Counters and histograms count what happened; gauges mirror state and are set
//! by the event that reports the state.

use std::time::Duration;

use sluice_schemas::DlqReason;

use crate::engine::ArenaStats;
use crate::metrics::Metrics;

/// A bucket as events name it: its name for logs, its metric label, and what the metrics and
/// messages need of it. Made by its owner ([`crate::models::Bucket::name`]).
pub(crate) struct BucketName {
    pub name: String,
    pub label: String,
    pub model: String,
    pub rows_per_task: usize,
}

pub(crate) trait Emit {
    fn emit(self, metrics: &Metrics);
}

/// A model call finished.
pub(crate) struct BatchRan<'a> {
    pub bucket: &'a BucketName,
    pub size: usize,
    pub elapsed: Duration,
}

impl Emit for BatchRan<'_> {
    fn emit(self, m: &Metrics) {
        let label = self.bucket.label.as_str();
        m.batches.with_label_values(&[label]).inc();
        m.batch_size.with_label_values(&[label]).observe(self.size as f64);
        m.inference_seconds
            .with_label_values(&[&self.bucket.model])
            .observe(self.elapsed.as_secs_f64());
        tracing::debug!(bucket = %self.bucket.name, size = self.size, ms = self.elapsed.as_millis() as u64, "batch ran");
    }
}

/// One model call returned its outputs (a batch's, or one call of a step-by-step batch's steps).
pub(crate) struct ModelCalled<'a> {
    pub model: &'a str,
    pub elapsed: Duration,
}

impl Emit for ModelCalled<'_> {
    fn emit(self, m: &Metrics) {
        m.model_call_seconds
            .with_label_values(&[self.model])
            .observe(self.elapsed.as_secs_f64());
    }
}

/// A batch ran out of memory and will run again smaller. A WARN, never an ERROR: it is handled.
pub(crate) struct OomHandled<'a> {
    pub bucket: &'a BucketName,
    pub from: usize,
    pub to: usize,
    pub task_ids: Vec<String>,
    pub dimensions: Vec<String>,
    pub error: &'a dyn std::fmt::Display,
}

impl Emit for OomHandled<'_> {
    fn emit(self, m: &Metrics) {
        m.ooms.with_label_values(&[&self.bucket.label]).inc();
        tracing::warn!(
            bucket = %self.bucket.name,
            batch_before = self.from,
            batch_after = self.to,
            rows = self.from * self.bucket.rows_per_task,
            dimensions = %self.dimensions.join(","),
            task_ids = %self.task_ids.join(","),
            error = %short(self.error),
            "out of memory; retrying with a smaller batch"
        );
    }
}

/// A task ran out of memory alone, with the device to itself, on a clean arena (or one of its
/// bucket, the same shape, did so a moment ago): it goes to the DLQ.
pub(crate) struct DoesNotFit<'a> {
    pub bucket: &'a BucketName,
    pub task_id: &'a str,
    pub dimensions: &'a str,
    /// Rows of the call that failed (the task's rows, or the part it was cut into).
    pub rows: usize,
    /// Why this is a verdict: "on a clean arena", or the earlier verdict it repeats.
    pub verdict: &'a str,
    pub error: &'a dyn std::fmt::Display,
}

impl Emit for DoesNotFit<'_> {
    fn emit(self, m: &Metrics) {
        m.ooms.with_label_values(&[&self.bucket.label]).inc();
        tracing::warn!(
            bucket = %self.bucket.name,
            task_id = self.task_id,
            dimensions = self.dimensions,
            rows = self.rows,
            verdict = self.verdict,
            error = %short(self.error),
            "out of memory at batch 1; the task does not fit and goes to the DLQ"
        );
    }
}

/// A task's rows ran out of memory together: it runs again with its rows in smaller parts.
pub(crate) struct RowsHalved<'a> {
    pub bucket: &'a BucketName,
    pub task_id: &'a str,
    pub dimensions: &'a str,
    pub from: usize,
    pub to: usize,
    pub error: &'a dyn std::fmt::Display,
}

impl Emit for RowsHalved<'_> {
    fn emit(self, m: &Metrics) {
        m.ooms.with_label_values(&[&self.bucket.label]).inc();
        tracing::warn!(
            bucket = %self.bucket.name,
            task_id = self.task_id,
            dimensions = self.dimensions,
            rows_before = self.from,
            rows_after = self.to,
            error = %short(self.error),
            "out of memory; running the task's rows in smaller parts"
        );
    }
}

/// Every session was rebuilt on a clean arena before the tasks named run: a task that ran out of
/// memory alone runs once more, or the size above its bucket's ceiling is probed. Arena figures
/// in bytes.
pub(crate) struct ArenaCleaned<'a> {
    pub bucket: &'a BucketName,
    pub task_ids: &'a [String],
    pub dimensions: &'a [String],
    pub arena_before: Option<u64>,
    pub arena_after: Option<u64>,
    pub arena_baseline: Option<u64>,
    pub clean: bool,
    pub elapsed: Duration,
}

impl Emit for ArenaCleaned<'_> {
    fn emit(self, _: &Metrics) {
        if self.clean {
            tracing::warn!(
                bucket = %self.bucket.name,
                task_ids = %self.task_ids.join(","),
                dimensions = %self.dimensions.join(","),
                batch = self.task_ids.len(),
                arena_before = ?self.arena_before,
                arena_after = ?self.arena_after,
                arena_baseline = ?self.arena_baseline,
                ms = self.elapsed.as_millis() as u64,
                "sessions rebuilt on a clean arena for the next call"
            );
        } else {
            tracing::error!(
                bucket = %self.bucket.name,
                arena_after = ?self.arena_after,
                arena_baseline = ?self.arena_baseline,
                "sessions rebuilt, but the arena holds more than after the first load: memory is held outside the sessions"
            );
        }
    }
}

/// A task that ran out of memory alone ran once more on a clean arena.
pub(crate) struct CleanRetryEnded<'a> {
    pub bucket: &'a BucketName,
    pub fit: bool,
}

impl Emit for CleanRetryEnded<'_> {
    fn emit(self, m: &Metrics) {
        let result = if self.fit { "fit" } else { "does_not_fit" };
        m.clean_arena_retries.with_label_values(&[result]).inc();
        tracing::info!(bucket = %self.bucket.name, result, "clean-arena retry ended");
    }
}

/// Learned ceilings read back at start.
pub(crate) struct CeilingsRestored<'a> {
    pub topic: &'a str,
    pub device: &'a str,
    pub count: usize,
    pub skipped: usize,
}

impl Emit for CeilingsRestored<'_> {
    fn emit(self, m: &Metrics) {
        m.ceilings_restored.set(self.count as i64);
        tracing::info!(
            topic = self.topic,
            device = self.device,
            ceilings = self.count,
            skipped = self.skipped,
            "learned batch ceilings restored"
        );
    }
}

/// A batch failed on its inputs (a model error or a panic): it is split to find the task.
pub(crate) struct Bisected<'a> {
    pub bucket: &'a BucketName,
    pub size: usize,
    pub error: &'a dyn std::fmt::Display,
}

impl Emit for Bisected<'_> {
    fn emit(self, _: &Metrics) {
        tracing::info!(bucket = %self.bucket.name, size = self.size, error = %short(self.error), "a batch failed on its inputs; splitting it to isolate the task");
    }
}

/// The learned ceiling of a bucket went up by one, to test whether more fits again.
pub(crate) struct CeilingProbed<'a> {
    pub bucket: &'a BucketName,
    pub to: usize,
}

impl Emit for CeilingProbed<'_> {
    fn emit(self, _: &Metrics) {
        tracing::info!(bucket = %self.bucket.name, batch = self.to, "probing a larger batch");
    }
}

/// Tasks joined a running batch of their bucket at a step boundary.
pub(crate) struct Joined<'a> {
    pub bucket: &'a BucketName,
    pub task_ids: &'a [String],
    /// Tasks in the batch's next call, theirs included.
    pub running: usize,
}

impl Emit for Joined<'_> {
    fn emit(self, m: &Metrics) {
        m.tasks_joined
            .with_label_values(&[self.bucket.label.as_str()])
            .inc_by(self.task_ids.len() as u64);
        tracing::debug!(bucket = %self.bucket.name, task_ids = ?self.task_ids, running = self.running, "joined a running batch");
    }
}

/// The learned ceiling of a bucket, when it is made or changes.
pub(crate) struct CeilingIs<'a> {
    /// The bucket's metric label.
    pub label: &'a str,
    pub limit: usize,
}

impl Emit for CeilingIs<'_> {
    fn emit(self, m: &Metrics) {
        m.batch_ceiling.with_label_values(&[self.label]).set(self.limit as i64);
    }
}

/// A record went to the DLQ (its DLQ record was acknowledged).
pub(crate) struct DeadLettered<'a> {
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

/// A step checkpoint of a task was written.
pub(crate) struct CheckpointWritten<'a> {
    pub task_id: &'a str,
    pub step: usize,
    pub bytes: u64,
    pub elapsed: Duration,
}

impl Emit for CheckpointWritten<'_> {
    fn emit(self, m: &Metrics) {
        m.checkpoints_written.inc();
        m.checkpoint_bytes.inc_by(self.bytes);
        tracing::debug!(
            task_id = self.task_id,
            step = self.step,
            bytes = self.bytes,
            ms = self.elapsed.as_millis() as u64,
            "checkpoint written"
        );
    }
}

/// A task carries on from its checkpoint at `step`, `saved` steps after its first.
pub(crate) struct CarriedOn<'a> {
    pub span: &'a tracing::Span,
    pub step: usize,
    pub saved: usize,
}

impl Emit for CarriedOn<'_> {
    fn emit(self, m: &Metrics) {
        m.checkpoint_resumes.inc();
        m.checkpoint_steps_saved.inc_by(self.saved as u64);
        tracing::info!(parent: self.span, step = self.step, saved = self.saved, "carrying on from a checkpoint");
    }
}

/// A task succeeded (its completion was acknowledged).
pub(crate) struct TaskSucceeded<'a> {
    pub task_id: &'a str,
    pub lane: sluice_schemas::Priority,
    pub images: usize,
    pub total: Duration,
    pub upload: Duration,
    pub duplicate: bool,
}

impl Emit for TaskSucceeded<'_> {
    fn emit(self, m: &Metrics) {
        m.tasks_finished.with_label_values(&["succeeded"]).inc();
        m.task_seconds
            .with_label_values(&[self.lane.name()])
            .observe(self.total.as_secs_f64());
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

/// A task ended without a result, cancelled or expired (its completion was acknowledged).
pub(crate) struct TaskEnded<'a> {
    pub task_id: &'a str,
    pub status: sluice_schemas::CompletionStatus,
}

impl Emit for TaskEnded<'_> {
    fn emit(self, m: &Metrics) {
        let outcome = match self.status {
            sluice_schemas::CompletionStatus::Expired => "expired",
            _ => "cancelled",
        };
        m.tasks_finished.with_label_values(&[outcome]).inc();
        tracing::info!(task_id = self.task_id, outcome, "task ended without running to its result");
    }
}

/// A transient failure will be retried after `delay`.
pub(crate) struct RetryScheduled<'a> {
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

/// A record was read from the tasks topic.
pub(crate) struct RecordReceived;

impl Emit for RecordReceived {
    fn emit(self, m: &Metrics) {
        m.tasks_received.inc();
    }
}

/// The poll loop came round again after `gap` (the longest is what matters: a poll thread that
/// stalls past `max.poll.interval.ms` costs the worker its partitions).
pub(crate) struct PollGap {
    pub gap: Duration,
}

impl Emit for PollGap {
    fn emit(self, m: &Metrics) {
        let gap = self.gap.as_secs_f64();
        if gap > m.poll_gap_max_seconds.get() {
            m.poll_gap_max_seconds.set(gap);
            if gap > 1.0 {
                tracing::warn!(gap_ms = self.gap.as_millis() as u64, "the poll loop stalled");
            }
        }
    }
}

/// Partitions were paused for backpressure, or resumed.
pub(crate) struct Paused<'a> {
    pub topic: &'a str,
    pub paused: bool,
    pub in_flight: usize,
    /// Task topics paused now, this one included.
    pub paused_topics: usize,
}

impl Emit for Paused<'_> {
    fn emit(self, m: &Metrics) {
        m.paused.set(self.paused_topics as i64);
        tracing::debug!(topic = self.topic, in_flight = self.in_flight, paused = self.paused, "backpressure");
    }
}

/// Partitions were assigned to this worker.
pub(crate) struct PartitionsAssigned<'a> {
    /// `(topic, partition)` of each.
    pub partitions: &'a [(&'a str, i32)],
    pub assigned_now: usize,
}

impl Emit for PartitionsAssigned<'_> {
    fn emit(self, m: &Metrics) {
        m.assigned_partitions.set(self.assigned_now as i64);
        m.rebalances.with_label_values(&["assign"]).inc();
        tracing::info!(
            partitions = ?self.partitions.iter().map(|(_, p)| p).collect::<Vec<_>>(),
            topics = ?topics_of(self.partitions),
            "partitions assigned"
        );
    }
}

/// Partitions were taken from this worker, after their in-flight work drained (or timed out)
/// and what finished was committed.
pub(crate) struct PartitionsRevoked<'a> {
    /// `(topic, partition)` of each.
    pub partitions: &'a [(&'a str, i32)],
    pub assigned_now: usize,
    pub drained: Duration,
    pub abandoned: usize,
    /// (topic, partition, offset) of each commit made before letting go.
    pub commits: &'a [(&'a str, i32, i64)],
    pub commit_error: Option<String>,
}

impl Emit for PartitionsRevoked<'_> {
    fn emit(self, m: &Metrics) {
        m.rebalances.with_label_values(&["revoke"]).inc();
        m.assigned_partitions.set(self.assigned_now as i64);
        match &self.commit_error {
            None => m.commits.inc_by(self.commits.len() as u64),
            Some(_) => m.commit_failures.inc(),
        }
        for (topic, partition) in self.partitions {
            let _ = m.consumer_lag.remove_label_values(&[*topic, &partition.to_string()]);
        }
        tracing::info!(
            partitions = ?self.partitions.iter().map(|(_, p)| p).collect::<Vec<_>>(),
            topics = ?topics_of(self.partitions),
            drained_ms = self.drained.as_millis() as u64,
            abandoned = self.abandoned,
            commits = ?self.commits,
            commit_error = self.commit_error,
            "partitions revoked"
        );
    }
}

/// The distinct topics of `partitions`, for logs.
fn topics_of<T: AsRef<str>>(partitions: &[(T, i32)]) -> Vec<&str> {
    let mut topics: Vec<&str> = partitions.iter().map(|(topic, _)| topic.as_ref()).collect();
    topics.sort_unstable();
    topics.dedup();
    topics
}

/// Partitions of the tasks topic were owned by no member of the stable group for longer than a
/// revocation may take; this worker made the group rebalance (see `source::orphans`).
pub(crate) struct OrphansRepaired<'a> {
    /// `(topic, partition)` of each.
    pub partitions: &'a [(String, i32)],
    pub unowned_for: Duration,
    /// Why the rebalance could not be made (tried again on the next look).
    pub error: Option<&'a str>,
}

impl Emit for OrphansRepaired<'_> {
    fn emit(self, m: &Metrics) {
        m.rebalances.with_label_values(&["orphans"]).inc();
        tracing::warn!(
            partitions = ?self.partitions.iter().map(|(_, p)| p).collect::<Vec<_>>(),
            topics = ?topics_of(self.partitions),
            unowned_for_ms = self.unowned_for.as_millis() as u64,
            error = self.error,
            "partitions of the task topics were owned by no member of the stable group; rebalanced it"
        );
    }
}

/// The consumer reported a rebalance error.
pub(crate) struct RebalanceFailed<'a> {
    pub error: &'a str,
}

impl Emit for RebalanceFailed<'_> {
    fn emit(self, _: &Metrics) {
        tracing::warn!(error = self.error, "rebalance error");
    }
}

/// Finished offsets were committed, or the commit failed (it is tried again on the next tick).
pub(crate) struct OffsetsCommitted<'a> {
    pub partitions: usize,
    /// How long the commit took (in exactly-once mode, its whole transaction).
    pub took: std::time::Duration,
    pub error: Option<&'a str>,
}

impl Emit for OffsetsCommitted<'_> {
    fn emit(self, m: &Metrics) {
        m.commit_seconds.observe(self.took.as_secs_f64());
        match self.error {
            None => m.commits.inc_by(self.partitions as u64),
            Some(error) => {
                m.commit_failures.inc();
                tracing::warn!(error, "offset commit failed; retrying on the next tick");
            }
        }
    }
}

/// Consumer lag of one partition, from the client's statistics and this worker's commits.
pub(crate) struct LagObserved<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub lag: i64,
}

impl Emit for LagObserved<'_> {
    fn emit(self, m: &Metrics) {
        m.consumer_lag
            .with_label_values(&[self.topic, &self.partition.to_string()])
            .set(self.lag);
    }
}

/// What the offset tracker holds: read at every scrape and on the gauge tick.
pub(crate) struct OffsetsObserved {
    pub in_flight: usize,
    pub uncommitted: usize,
    pub oldest: Option<Duration>,
}

impl Emit for OffsetsObserved {
    fn emit(self, m: &Metrics) {
        m.in_flight.set(self.in_flight as i64);
        m.uncommitted.set(self.uncommitted as i64);
        m.oldest_in_flight_seconds.set(self.oldest.map_or(0.0, |d| d.as_secs_f64()));
    }
}

/// Process memory, sampled on the gauge tick.
pub(crate) struct MemorySampled {
    pub rss_bytes: u64,
    pub arena: Option<ArenaStats>,
}

impl Emit for MemorySampled {
    fn emit(self, m: &Metrics) {
        m.rss_bytes.set(self.rss_bytes as i64);
        if let Some(arena) = self.arena {
            m.arena_in_use_bytes.set(arena.in_use as i64);
            m.arena_allocated_bytes.set(arena.total_allocated as i64);
        }
    }
}

/// A model was loaded (or dropped).
pub(crate) struct ModelLoaded<'a> {
    pub model: &'a str,
    pub loaded: bool,
}

impl Emit for ModelLoaded<'_> {
    fn emit(self, m: &Metrics) {
        m.model_loaded.with_label_values(&[self.model]).set(self.loaded as i64);
    }
}

/// A reload ended: `result` is `reloaded`, `fell_back` or `fatal`.
pub(crate) struct ReloadEnded<'a> {
    pub model: &'a str,
    pub result: &'a str,
}

impl Emit for ReloadEnded<'_> {
    fn emit(self, m: &Metrics) {
        m.reloads.with_label_values(&[self.model, self.result]).inc();
    }
}

fn short(error: &dyn std::fmt::Display) -> String {
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
