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
use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use sluice_service::kafka::{KafkaClientArgs, WholeTopics};
use thiserror::Error;

use super::{Change, StatusStore};
use crate::events::{Emit, ViewRecordRead};
use crate::metrics::Metrics;

/// The topics the view reads.
#[derive(Debug, Clone)]
pub struct ViewTopics {
    /// The task topics: the tasks topic and each lane's own.
    pub tasks: Vec<String>,
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
    if topics.tasks.iter().any(|t| t == topic) {
        let r: sluice_schemas::TaskRecord = serde_json::from_slice(payload).ok()?;
        // A redriven record is the original, byte for byte, with its attempt in a header.
        let attempt = sluice_schemas::attempt_of(
            m.headers()
                .and_then(|h| h.iter().find(|h| h.key == sluice_schemas::HEADER_ATTEMPT).and_then(|h| h.value)),
        );
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

/// What can keep the feed from starting.
#[derive(Debug, Error)]
pub enum FeedError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Thread(#[from] std::io::Error),
}

/// Starts the view thread. It runs until the process exits; store errors are logged and the
/// batch retried.
pub fn start(
    kafka: &KafkaClientArgs,
    topics: ViewTopics,
    store: Arc<StatusStore>,
    metrics: Metrics,
    retention: Retention,
) -> Result<CaughtUp, FeedError> {
    let consumer: BaseConsumer = kafka.whole_topic_config("sluice-status-view").create()?;
    let caught_up = CaughtUp::default();
    let flag = caught_up.clone();
    std::thread::Builder::new()
        .name("status-view".into())
        .spawn(move || Feed::new(consumer, topics, store, metrics, retention, flag).run())?;
    Ok(caught_up)
}

/// The view thread's state.
struct Feed {
    consumer: BaseConsumer,
    topics: ViewTopics,
    store: Arc<StatusStore>,
    metrics: Metrics,
    retention: Retention,
    caught_up: CaughtUp,
    whole: WholeTopics,
    /// How far each partition has been read: the next offset, by `(topic, partition)`.
    read_to: HashMap<(String, i32), i64>,
    /// High watermarks at the start: reaching them all is "caught up".
    targets: Option<Vec<(String, i32, i64)>>,
    last_metadata: Instant,
    last_prune: Instant,
}

impl Feed {
    /// A feed that reads on from where the store stopped, if it was kept.
    fn new(
        consumer: BaseConsumer,
        topics: ViewTopics,
        store: Arc<StatusStore>,
        metrics: Metrics,
        retention: Retention,
        caught_up: CaughtUp,
    ) -> Feed {
        let names: Vec<String> = topics
            .tasks
            .iter()
            .chain([&topics.progress, &topics.completions])
            .cloned()
            .collect();
        let read_to = store.positions().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "status view: stored positions unreadable; reading the topics from their beginning");
            Default::default()
        });
        if !read_to.is_empty() {
            tracing::info!(partitions = read_to.len(), "status view: reading on from the stored positions");
        }
        let whole = WholeTopics::new(names).starting_at(read_to.clone());
        Feed {
            consumer,
            topics,
            store,
            metrics,
            retention,
            caught_up,
            whole,
            read_to,
            targets: None,
            last_metadata: Instant::now() - Duration::from_secs(60),
            last_prune: Instant::now(),
        }
    }

    /// Reads, applies and prunes, until the process exits.
    fn run(mut self) {
        loop {
            if self.last_metadata.elapsed() >= Duration::from_secs(5) {
                self.last_metadata = Instant::now();
                self.assign();
            }
            let (changes, read) = self.poll();
            self.apply(&changes, &read);
            self.check_caught_up();
            if self.last_prune.elapsed() >= Duration::from_secs(600) {
                self.last_prune = Instant::now();
                self.prune();
            }
        }
    }

    /// Assigns the topics' partitions as the metadata now has them; the first time there are
    /// some, also reads where they end.
    fn assign(&mut self) {
        if let Err(e) = self.whole.refresh(&self.consumer) {
            tracing::warn!(error = %e, "status view: assigning partitions failed");
        }
        if self.targets.is_none() && !self.whole.partitions().is_empty() {
            self.read_targets();
        }
    }

    /// Every assigned partition's high watermark, or none: a partition left out would be
    /// "caught up" without having been read.
    fn read_targets(&mut self) {
        match self.whole.ends(&self.consumer) {
            Ok(t) => {
                // A stored position past a partition's end is of a topic since recreated: only
                // what is read now counts.
                for (topic, p, high) in &t {
                    if self.read_to.get(&(topic.clone(), *p)).is_some_and(|n| n > high) {
                        self.read_to.remove(&(topic.clone(), *p));
                    }
                }
                self.targets = Some(t)
            }
            Err(e) => tracing::warn!(error = %e, "status view: reading the topics' ends failed; trying again"),
        }
    }

    /// One batch: the changes read within 50 ms (1024 at most), and how far each partition was
    /// read, `(topic, partition, next offset)`.
    fn poll(&self) -> (Vec<Change>, Vec<(String, i32, i64)>) {
        let mut changes = Vec::new();
        let mut read: HashMap<(String, i32), i64> = HashMap::new();
        let deadline = Instant::now() + Duration::from_millis(50);
        while changes.len() < 1024 && Instant::now() < deadline {
            match self.consumer.poll(Duration::from_millis(20)) {
                Some(Ok(m)) => {
                    read.insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
                    if let Some((change, at)) = decode(&self.topics, &m) {
                        ViewRecordRead { at }.emit(&self.metrics);
                        changes.push(change);
                    }
                }
                Some(Err(e)) => tracing::debug!(error = %e, "status view: poll"),
                None => break,
            }
        }
        let read = read.into_iter().map(|((t, p), o)| (t, p, o)).collect();
        (changes, read)
    }

    /// Writes a batch and how far it read to the store, retrying until the write succeeds.
    fn apply(&mut self, changes: &[Change], read: &[(String, i32, i64)]) {
        for (t, p, o) in read {
            self.read_to.insert((t.clone(), *p), *o);
        }
        while let Err(e) = self.store.apply_read(changes, read) {
            tracing::warn!(error = %e, "status view: store write failed; retrying");
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Marks the view caught up once every partition has been read to where it ended at start.
    fn check_caught_up(&self) {
        if !self.caught_up.get()
            && let Some(t) = &self.targets
            && WholeTopics::reached(&self.consumer, t, |topic, p| self.read_to.get(&(topic.to_owned(), p)).copied())
        {
            self.caught_up.0.store(true, Ordering::Relaxed);
            tracing::info!("status view caught up with its topics");
        }
    }

    /// Drops the tasks past their retention.
    fn prune(&self) {
        let ago = |d: Duration| Utc::now() - chrono::Duration::from_std(d).unwrap_or_default();
        match self.store.prune(ago(self.retention.finished), ago(self.retention.unfinished)) {
            Ok(n) if n > 0 => tracing::info!(removed = n, "status view: pruned tasks past retention"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "status view: pruning failed"),
        }
    }
}
