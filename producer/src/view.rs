//! Feeds the status view ([`crate::status`]) from the topics: one consumer that is assigned every
//! partition of the tasks, progress and completion topics from their beginning, or from where a
//! kept store stopped (no consumer group: every replica reads everything), on a thread of its
//! own. New partitions are picked up
//! by re-reading the metadata every few seconds.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rdkafka::Offset;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use sluice_service::kafka::{KafkaClientArgs, WholeTopics};

use crate::metrics::Metrics;
use crate::status::{Change, StatusStore};

/// The topics the view reads.
#[derive(Debug, Clone)]
pub struct ViewTopics {
    pub tasks: String,
    pub progress: String,
    pub completions: String,
}

/// Whether the view has read everything that was on its topics when it started.
#[derive(Clone, Default)]
pub struct CaughtUp(Arc<AtomicBool>);

impl CaughtUp {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

fn decode(topics: &ViewTopics, m: &rdkafka::message::BorrowedMessage<'_>) -> Option<(Change, DateTime<Utc>)> {
    use rdkafka::message::Headers;
    let (topic, payload) = (m.topic(), m.payload()?);
    if topic == topics.tasks {
        let r: sluice_schemas::TaskRecord = serde_json::from_slice(payload).ok()?;
        // A redriven record is the original, byte for byte, with its attempt in a header.
        let attempt = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == sluice_schemas::HEADER_ATTEMPT).and_then(|h| h.value))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u32>().ok())
            .unwrap_or(1);
        if attempt > 1 {
            let at = m
                .timestamp()
                .to_millis()
                .and_then(DateTime::from_timestamp_millis)
                .unwrap_or_else(Utc::now);
            return Some((Change::Redriven { record: r, attempt, at }, at));
        }
        let at = r.submitted_at;
        Some((Change::Queued(r), at))
    } else if topic == topics.progress {
        let p: sluice_schemas::ProgressRecord = serde_json::from_slice(payload).ok()?;
        let at = p.at;
        Some((Change::Progress(p), at))
    } else if topic == topics.completions {
        let c: sluice_schemas::CompletionEvent = serde_json::from_slice(payload).ok()?;
        let at = c.completed_at;
        Some((Change::Completed(c), at))
    } else {
        None
    }
}

/// How long the view keeps a task after its last change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// A finished task (`SLUICE_STATUS_RETENTION_HOURS`).
    pub finished: Duration,
    /// A task that has not finished: the longest deadline any model allows, plus `finished`, so
    /// that a queued task stays until it has expired and then as long as a finished one.
    pub unfinished: Duration,
}

impl Retention {
    /// `finished` for finished tasks; unfinished ones also for `longest_ttl` (the catalog's
    /// largest `max_ttl_seconds`).
    pub fn new(finished: Duration, longest_ttl: Duration) -> Retention {
        Retention {
            finished,
            unfinished: finished + longest_ttl,
        }
    }
}

/// Starts the view thread. It runs until the process exits; store errors are logged and the
/// batch retried.
pub fn start(
    kafka: &KafkaClientArgs,
    topics: ViewTopics,
    store: Arc<StatusStore>,
    metrics: Metrics,
    retention: Retention,
) -> anyhow::Result<CaughtUp> {
    let consumer: BaseConsumer = kafka.whole_topic_config("sluice-status-view").create()?;
    let caught_up = CaughtUp::default();
    let flag = caught_up.clone();
    std::thread::Builder::new().name("status-view".into()).spawn(move || {
        let names = [topics.tasks.clone(), topics.progress.clone(), topics.completions.clone()];
        // A kept store reads on from where it stopped.
        let mut read_to = store.positions().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "status view: stored positions unreadable; reading the topics from their beginning");
            Default::default()
        });
        if !read_to.is_empty() {
            tracing::info!(partitions = read_to.len(), "status view: reading on from the stored positions");
        }
        let mut whole = WholeTopics::new(names.to_vec()).starting_at(read_to.clone());
        // High watermarks at the start: reaching them all is "caught up".
        let mut targets: Option<Vec<(String, i32, i64)>> = None;
        let mut last_metadata = Instant::now() - Duration::from_secs(60);
        let mut last_prune = Instant::now();
        loop {
            if last_metadata.elapsed() >= Duration::from_secs(5) {
                last_metadata = Instant::now();
                if let Err(e) = whole.refresh(&consumer) {
                    tracing::warn!(error = %e, "status view: assigning partitions failed");
                }
                let assigned = whole.partitions();
                if targets.is_none() && !assigned.is_empty() {
                    // Every partition's watermark, or none: a partition left out would be
                    // "caught up" without having been read.
                    let t: Result<Vec<(String, i32, i64)>, _> = assigned
                        .iter()
                        .map(|(t, p)| {
                            consumer
                                .fetch_watermarks(t, *p, Duration::from_secs(5))
                                .map(|(low, high)| (t.clone(), *p, if low == high { 0 } else { high }))
                        })
                        .collect();
                    match t {
                        Ok(t) => {
                            // A stored position past a partition's end is of a topic since
                            // recreated: only what is read now counts.
                            for (topic, p, high) in &t {
                                if read_to.get(&(topic.clone(), *p)).is_some_and(|n| n > high) {
                                    read_to.remove(&(topic.clone(), *p));
                                }
                            }
                            targets = Some(t)
                        }
                        Err(e) => tracing::warn!(error = %e, "status view: reading the topics' ends failed; trying again"),
                    }
                }
            }
            let mut changes = Vec::new();
            let mut read: HashMap<(String, i32), i64> = HashMap::new();
            let deadline = Instant::now() + Duration::from_millis(50);
            while changes.len() < 1024 && Instant::now() < deadline {
                match consumer.poll(Duration::from_millis(20)) {
                    Some(Ok(m)) => {
                        read.insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
                        if let Some((change, at)) = decode(&topics, &m) {
                            metrics.view_lag_seconds.observe(crate::status::lag_of(at).as_secs_f64());
                            changes.push(change);
                        }
                    }
                    Some(Err(e)) => tracing::debug!(error = %e, "status view: poll"),
                    None => break,
                }
            }
            let read: Vec<(String, i32, i64)> = read.into_iter().map(|((t, p), o)| (t, p, o)).collect();
            for (t, p, o) in &read {
                read_to.insert((t.clone(), *p), *o);
            }
            while let Err(e) = store.apply_read(&changes, &read) {
                tracing::warn!(error = %e, "status view: store write failed; retrying");
                std::thread::sleep(Duration::from_secs(1));
            }
            if !flag.get()
                && let Some(t) = &targets
                && let Ok(pos) = consumer.position()
                && t.iter().all(|(topic, p, high)| {
                    *high == 0
                        || read_to.get(&(topic.clone(), *p)).is_some_and(|n| n >= high)
                        || pos
                            .find_partition(topic, *p)
                            .is_some_and(|e| matches!(e.offset(), Offset::Offset(o) if o >= *high))
                })
            {
                flag.0.store(true, Ordering::Relaxed);
                tracing::info!("status view caught up with its topics");
            }
            if last_prune.elapsed() >= Duration::from_secs(600) {
                last_prune = Instant::now();
                let ago = |d: Duration| Utc::now() - chrono::Duration::from_std(d).unwrap_or_default();
                match store.prune(ago(retention.finished), ago(retention.unfinished)) {
                    Ok(n) if n > 0 => tracing::info!(removed = n, "status view: pruned tasks past retention"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "status view: pruning failed"),
                }
            }
        }
    })?;
    Ok(caught_up)
}
