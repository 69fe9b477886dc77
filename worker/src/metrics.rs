//! Every Prometheus metric of the worker, registered in one place. Only [`crate::events`] writes
//! them (see the rule there).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, exponential_buckets,
};
use sluice_service::metrics::register;

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub(crate) tasks_received: IntCounter,
    pub(crate) tasks_finished: IntCounterVec,
    pub(crate) dlq_records: IntCounterVec,
    pub(crate) duplicates_skipped: IntCounter,
    pub(crate) checkpoints_written: IntCounter,
    pub(crate) checkpoint_bytes: IntCounter,
    pub(crate) checkpoint_resumes: IntCounter,
    pub(crate) checkpoint_steps_saved: IntCounter,
    pub(crate) batches: IntCounterVec,
    pub(crate) tasks_joined: IntCounterVec,
    pub(crate) batch_size: HistogramVec,
    pub(crate) batch_ceiling: IntGaugeVec,
    pub(crate) ooms: IntCounterVec,
    pub(crate) clean_arena_retries: IntCounterVec,
    pub(crate) ceilings_restored: IntGauge,
    pub(crate) inference_seconds: HistogramVec,
    pub(crate) model_call_seconds: HistogramVec,
    pub(crate) upload_seconds: Histogram,
    pub(crate) task_seconds: HistogramVec,
    pub(crate) in_flight: IntGauge,
    pub(crate) uncommitted: IntGauge,
    pub(crate) oldest_in_flight_seconds: prometheus::Gauge,
    pub(crate) consumer_lag: IntGaugeVec,
    pub(crate) commits: IntCounter,
    pub(crate) commit_failures: IntCounter,
    pub(crate) commit_seconds: Histogram,
    pub(crate) retries: IntCounterVec,
    pub(crate) paused: IntGauge,
    pub(crate) poll_gap_max_seconds: prometheus::Gauge,
    pub(crate) assigned_partitions: IntGauge,
    pub(crate) rebalances: IntCounterVec,
    pub(crate) reloads: IntCounterVec,
    pub(crate) model_loaded: IntGaugeVec,
    pub(crate) rss_bytes: IntGauge,
    pub(crate) arena_in_use_bytes: IntGauge,
    pub(crate) arena_allocated_bytes: IntGauge,
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("metric options")
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("metric options")
}

fn seconds(name: &str, help: &str) -> HistogramOpts {
    HistogramOpts::new(name, help).buckets(exponential_buckets(0.001, 2.0, 18).expect("buckets"))
}

impl Metrics {
    /// Out-of-memory errors handled so far in the buckets of size class `label` (`Bucket::label`).
    pub fn ooms(&self, label: &str) -> u64 {
        self.ooms.with_label_values(&[label]).get()
    }

    pub fn new() -> Metrics {
        let r = Registry::new();
        Metrics {
            tasks_received: register(
                &r,
                IntCounter::new("sluice_worker_tasks_received_total", "Records read from the tasks topic").unwrap(),
            ),
            tasks_finished: register(
                &r,
                counter_vec(
                    "sluice_worker_tasks_finished_total",
                    "Tasks finished, by status (succeeded, failed)",
                    &["status"],
                ),
            ),
            dlq_records: register(
                &r,
                counter_vec("sluice_worker_dlq_records_total", "Records sent to the DLQ, by reason", &["reason"]),
            ),
            duplicates_skipped: register(
                &r,
                IntCounter::new(
                    "sluice_worker_duplicates_skipped_total",
                    "Redelivered tasks whose results already existed: announced again, not run again",
                )
                .unwrap(),
            ),
            checkpoints_written: register(
                &r,
                IntCounter::new("sluice_worker_checkpoints_written_total", "Step checkpoints written to object storage").unwrap(),
            ),
            checkpoint_bytes: register(
                &r,
                IntCounter::new("sluice_worker_checkpoint_bytes_total", "Bytes of the step checkpoints written").unwrap(),
            ),
            checkpoint_resumes: register(
                &r,
                IntCounter::new("sluice_worker_checkpoint_resumes_total", "Tasks that carried on from a step checkpoint").unwrap(),
            ),
            checkpoint_steps_saved: register(
                &r,
                IntCounter::new(
                    "sluice_worker_checkpoint_steps_saved_total",
                    "Denoising steps not run again because a task carried on from its checkpoint",
                )
                .unwrap(),
            ),
            batches: register(
                &r,
                counter_vec("sluice_worker_batches_total", "Model calls, by size class (bucket label: model:le<work>)", &["bucket"]),
            ),
            tasks_joined: register(
                &r,
                counter_vec(
                    "sluice_worker_tasks_joined_total",
                    "Tasks that joined a running batch of their bucket at a step boundary, by size class",
                    &["bucket"],
                ),
            ),
            batch_size: register(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("sluice_worker_batch_size", "Tasks per model call, by size class")
                        .buckets(vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0]),
                    &["bucket"],
                )
                .unwrap(),
            ),
            batch_ceiling: register(
                &r,
                gauge_vec(
                    "sluice_worker_batch_ceiling",
                    "Learned largest batch (tasks): the last one learned in the size class",
                    &["bucket"],
                ),
            ),
            ooms: register(
                &r,
                counter_vec("sluice_worker_oom_total", "Out-of-memory errors handled, by size class", &["bucket"]),
            ),
            clean_arena_retries: register(
                &r,
                counter_vec(
                    "sluice_worker_clean_arena_retries_total",
                    "Tasks that ran out of memory alone and ran once more on a clean arena (sessions rebuilt), by result (fit, does_not_fit)",
                    &["result"],
                ),
            ),
            ceilings_restored: register(
                &r,
                IntGauge::new(
                    "sluice_worker_ceilings_restored",
                    "Learned batch ceilings this worker started from, read from the ceilings topic at start",
                )
                .unwrap(),
            ),
            inference_seconds: register(
                &r,
                HistogramVec::new(
                    seconds(
                        "sluice_worker_inference_seconds",
                        "Duration of batches, from their first turn at the device to their end (a step-by-step batch: all its calls and the waits between them)",
                    ),
                    &["model"],
                )
                .unwrap(),
            ),
            model_call_seconds: register(
                &r,
                HistogramVec::new(
                    seconds(
                        "sluice_worker_model_call_seconds",
                        "Duration of single model calls that returned outputs, from their turn at the device to their reply (a step-by-step batch makes one a call of its steps)",
                    ),
                    &["model"],
                )
                .unwrap(),
            ),
            upload_seconds: register(
                &r,
                Histogram::with_opts(seconds("sluice_worker_upload_seconds", "Duration of storing one task's images")).unwrap(),
            ),
            task_seconds: register(
                &r,
                HistogramVec::new(
                    seconds("sluice_worker_task_seconds", "From submission to completion, by the task's priority lane"),
                    &["lane"],
                )
                .unwrap(),
            ),
            in_flight: register(
                &r,
                IntGauge::new("sluice_worker_in_flight_tasks", "Tasks read and not yet finished").unwrap(),
            ),
            uncommitted: register(
                &r,
                IntGauge::new(
                    "sluice_worker_uncommitted_records",
                    "Records read whose offsets are not committed yet (read again if this worker dies now)",
                )
                .unwrap(),
            ),
            oldest_in_flight_seconds: register(
                &r,
                prometheus::Gauge::new("sluice_worker_oldest_in_flight_seconds", "Age of the oldest unfinished task").unwrap(),
            ),
            consumer_lag: register(
                &r,
                gauge_vec(
                    "sluice_worker_consumer_lag",
                    "High watermark minus committed offset, per assigned partition",
                    &["topic", "partition"],
                ),
            ),
            commits: register(&r, IntCounter::new("sluice_worker_commits_total", "Offset commits").unwrap()),
            commit_failures: register(
                &r,
                IntCounter::new(
                    "sluice_worker_commit_failures_total",
                    "Offset commits that failed (retried on the next tick)",
                )
                .unwrap(),
            ),
            commit_seconds: register(
                &r,
                Histogram::with_opts(seconds(
                    "sluice_worker_commit_seconds",
                    "Duration of offset commits: in exactly-once mode each is a transaction with the outcomes it announces",
                ))
                .unwrap(),
            ),
            retries: register(
                &r,
                counter_vec(
                    "sluice_worker_retries_total",
                    "Retries of transient failures, by operation",
                    &["operation"],
                ),
            ),
            poll_gap_max_seconds: register(
                &r,
                prometheus::Gauge::new(
                    "sluice_worker_poll_gap_max_seconds",
                    "Longest time between two polls of the tasks consumer so far (the poll thread must stay well inside max.poll.interval.ms)",
                )
                .unwrap(),
            ),
            paused: register(
                &r,
                IntGauge::new(
                    "sluice_worker_paused",
                    "Task topics whose partitions are paused for backpressure (1 while paused, with one tasks topic)",
                ).unwrap(),
            ),
            assigned_partitions: register(
                &r,
                IntGauge::new(
                    "sluice_worker_assigned_partitions",
                    "Partitions of the tasks topic assigned to this worker",
                )
                .unwrap(),
            ),
            rebalances: register(
                &r,
                counter_vec("sluice_worker_rebalances_total", "Partition assignments and revocations, and rebalances this worker made to hand out orphaned partitions (kind=orphans)", &["kind"]),
            ),
            reloads: register(
                &r,
                counter_vec(
                    "sluice_worker_reloads_total",
                    "Model reloads, by model and result",
                    &["model", "result"],
                ),
            ),
            model_loaded: register(
                &r,
                gauge_vec("sluice_worker_model_loaded", "1 when the model is loaded and serving", &["model"]),
            ),
            rss_bytes: register(
                &r,
                IntGauge::new("sluice_worker_rss_bytes", "Resident set size of the process").unwrap(),
            ),
            arena_in_use_bytes: register(
                &r,
                IntGauge::new("sluice_worker_arena_in_use_bytes", "Bytes in use in the shared CPU arena").unwrap(),
            ),
            arena_allocated_bytes: register(
                &r,
                IntGauge::new("sluice_worker_arena_allocated_bytes", "Bytes the shared CPU arena holds").unwrap(),
            ),
            registry: r,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Resident set size of this process, bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map(|pages| pages * page_size())
        .unwrap_or(0)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

/// Memory the system can still give, bytes (`MemAvailable`).
pub fn available_memory_bytes() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The machine's memory, bytes.
pub fn total_memory_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
