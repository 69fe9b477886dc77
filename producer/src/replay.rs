//! Replay and redrive: copying records back onto the task topics, each to its lane's.
//!
//! Both read a fixed range of a topic — per partition from a start (an offset, a time, or the
//! beginning) to an end fixed when the run starts (an offset, a time, or the high watermark at
//! that moment, so that replaying a topic into itself ends) — and write what passes the filters
//! to the task topic of its lane (`priority`; the tasks topic where the lane has none of its
//! own), each record marked with the header `sluice-origin`. Workers check marked
//! records for existing results first, so copying a task that already finished re-announces its
//! completion instead of running it again: both are safe to repeat.
//!
//! Replay copies task records byte for byte (key, value, headers). Redrive copies the original
//! record a DLQ record carries, and counts the attempt up in `sluice-attempt`. One run never
//! writes the same task twice: a task that reached the DLQ more than once is redriven once.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use sluice_schemas::topics::TaskTopics;
use sluice_schemas::{DlqReason, DlqRecord, HEADER_ATTEMPT, HEADER_ORIGIN, Priority, attempt_of};
use thiserror::Error;
use tokio::sync::mpsc::{Receiver, Sender};

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("topic {0} does not exist or has no partitions")]
    NoTopic(String),
    #[error("partition {partition} is not in topic {topic}")]
    NoPartition { topic: String, partition: i32 },
    #[error("writing to {topic} failed after {written} records: {source}")]
    Write { topic: String, written: u64, source: KafkaError },
}

/// Where each partition's range starts or ends.
#[derive(Debug, Clone, Default)]
pub struct Bounds {
    /// Only these partitions (all when empty).
    pub partitions: Vec<i32>,
    /// Start offsets by partition (inclusive); others start at `since` or the beginning.
    pub from_offsets: BTreeMap<i32, i64>,
    /// End offsets by partition (exclusive); others end at `until` or the high watermark.
    pub to_offsets: BTreeMap<i32, i64>,
    /// Records at or after this time (by record timestamp; needs broker timestamp lookup).
    pub since: Option<DateTime<Utc>>,
    /// Records before this time.
    pub until: Option<DateTime<Utc>>,
}

/// Which records a run copies.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Replay: only tasks of these models (all when empty).
    pub models: Vec<String>,
    /// Replay: only tasks of these tenants (all when empty).
    pub tenants: Vec<String>,
    /// Redrive: only DLQ records with these reasons (all when empty).
    pub reasons: Vec<DlqReason>,
}

/// What to do with the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Copy task records as they are.
    Replay,
    /// Copy the original records DLQ records carry.
    Redrive,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Replay => "replay",
            Mode::Redrive => "redrive",
        }
    }
}

/// Counts of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Records read from the range.
    pub read: u64,
    /// Records written to the tasks topic (in a dry run: that would be written).
    pub written: u64,
    /// Left out by the filters.
    pub filtered: u64,
    /// Left out because this run already wrote the same task.
    pub duplicates: u64,
    /// Left out because they could not be read as what the mode expects (a record that is not
    /// a task cannot be filtered by model; a DLQ topic record that is not a DLQ record).
    pub unreadable: u64,
    pub dry_run: bool,
    pub seconds: f64,
}

/// One partition's part of a run: offsets `[start, end)`. Times were turned into offsets by the
/// broker's own lookup (`offsets_for_times`: the first record stamped at or after the time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: i64,
    pub end: i64,
}

impl Range {
    /// Offsets in the range.
    pub fn len(&self) -> i64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One record to write.
struct Copy {
    key: Option<Vec<u8>>,
    value: Vec<u8>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    /// The task's lane: which task topic the copy is written to.
    lane: Priority,
}

/// The lane a task record names (`standard` where it names none, or is not a task record).
fn lane_of(task: Option<&serde_json::Value>) -> Priority {
    task.and_then(|t| t.get("priority"))
        .and_then(|p| p.as_str())
        .and_then(Priority::parse)
        .unwrap_or_default()
}

/// Resolves each partition's range in `topic`.
pub fn resolve(consumer: &BaseConsumer, topic: &str, bounds: &Bounds, timeout: Duration) -> Result<BTreeMap<i32, Range>, ReplayError> {
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let all: Vec<i32> = metadata
        .topics()
        .first()
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if all.is_empty() {
        return Err(ReplayError::NoTopic(topic.to_owned()));
    }
    let partitions = if bounds.partitions.is_empty() {
        all.clone()
    } else {
        bounds.partitions.clone()
    };
    for p in partitions.iter().chain(bounds.from_offsets.keys()).chain(bounds.to_offsets.keys()) {
        if !all.contains(p) {
            return Err(ReplayError::NoPartition {
                topic: topic.to_owned(),
                partition: *p,
            });
        }
    }
    let by_time = |time: Option<DateTime<Utc>>| -> Result<BTreeMap<i32, i64>, ReplayError> {
        let Some(time) = time else { return Ok(BTreeMap::new()) };
        let mut tpl = TopicPartitionList::new();
        for p in &partitions {
            tpl.add_partition_offset(topic, *p, Offset::Offset(time.timestamp_millis()))?;
        }
        let found = consumer.offsets_for_times(tpl, timeout)?;
        Ok(found
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((e.partition(), o)),
                // No record at or after the time: the range of that partition is empty.
                Offset::End => Some((e.partition(), i64::MAX)),
                _ => None,
            })
            .collect())
    };
    // The watermarks first: a record appended after the time lookups found nothing at or after
    // a time would otherwise lie between the lookup and a later end, and be left out.
    let mut watermarks = BTreeMap::new();
    for p in &partitions {
        watermarks.insert(*p, consumer.fetch_watermarks(topic, *p, timeout)?);
    }
    let since = by_time(bounds.since)?;
    let until = by_time(bounds.until)?;
    let mut ranges = BTreeMap::new();
    for (p, (low, high)) in watermarks {
        // An explicit offset wins over a time for the same end of the range.
        let start = bounds.from_offsets.get(&p).or(since.get(&p)).copied().unwrap_or(low);
        let end = bounds.to_offsets.get(&p).or(until.get(&p)).copied().unwrap_or(high);
        let start = start.clamp(low, high);
        let end = end.clamp(start, high);
        ranges.insert(p, Range { start, end });
    }
    Ok(ranges)
}

/// Copies the range of `source` to the task topics, each record to its lane's; `progress` is told
/// of every record read.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    mode: Mode,
    consumer: BaseConsumer,
    producer: &FutureProducer,
    source: &str,
    topics: &TaskTopics,
    ranges: &BTreeMap<i32, Range>,
    filter: &Filter,
    dry_run: bool,
    progress: impl Fn(&Summary),
) -> Result<Summary, ReplayError> {
    let started = std::time::Instant::now();
    let summary = Summary {
        dry_run,
        ..Summary::default()
    };
    let (tpl, open) = assignment(source, ranges)?;
    if open.is_empty() {
        return Ok(summary);
    }
    consumer.assign(&tpl)?;
    let consumer = std::sync::Arc::new(consumer);
    // Records are read on a blocking thread and written from here, at most 256 awaiting their
    // acknowledgement.
    let (tx, rx) = tokio::sync::mpsc::channel::<Read>(1024);
    let reader = {
        let consumer = consumer.clone();
        let source = source.to_owned();
        let filter = filter.clone();
        tokio::task::spawn_blocking(move || read_ranges(&consumer, mode, &source, &filter, open, &tx))
    };
    let mut tally = Tally {
        mode,
        source,
        summary,
        seen: HashSet::new(),
    };
    write_all(producer, topics, rx, &mut tally, &progress).await?;
    reader.await.ok();
    let mut summary = tally.summary;
    summary.seconds = started.elapsed().as_secs_f64();
    progress(&summary);
    Ok(summary)
}

/// What the reader sends of each record: its partition, offset, copy and outcome; or the
/// consume error that stopped it.
type Read = Result<(i32, i64, Option<Copy>, Outcome), KafkaError>;

/// The partitions to read, each from its range's start, and each one's end; empty ranges left
/// out.
fn assignment(source: &str, ranges: &BTreeMap<i32, Range>) -> Result<(TopicPartitionList, BTreeMap<i32, i64>), KafkaError> {
    let mut tpl = TopicPartitionList::new();
    // Each open partition's end.
    let mut open: BTreeMap<i32, i64> = BTreeMap::new();
    for (p, range) in ranges {
        if !range.is_empty() {
            tpl.add_partition_offset(source, *p, Offset::Offset(range.start))?;
            open.insert(*p, range.end);
        }
    }
    Ok((tpl, open))
}

/// Reads the `open` partitions up to their ends (on a blocking thread), sending what each record
/// comes to; stops early at a consume error (sent on) or once the writer is gone.
fn read_ranges(consumer: &BaseConsumer, mode: Mode, source: &str, filter: &Filter, mut open: BTreeMap<i32, i64>, tx: &Sender<Read>) {
    let mut checked = std::time::Instant::now();
    while !open.is_empty() {
        if checked.elapsed() >= Duration::from_millis(200) {
            checked = std::time::Instant::now();
            close_reached(consumer, source, &mut open);
        }
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = match message {
            Ok(m) => m,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        let (p, o) = (m.partition(), m.offset());
        let Some(&end) = open.get(&p) else { continue };
        if o + 1 >= end {
            open.remove(&p);
        }
        if o >= end {
            continue;
        }
        let (copy, outcome) = select(mode, source, &m, filter);
        if tx.blocking_send(Ok((p, o, copy, outcome))).is_err() {
            return;
        }
    }
}

/// Closes the open partitions whose position reached their end.
fn close_reached(consumer: &BaseConsumer, source: &str, open: &mut BTreeMap<i32, i64>) {
    // A transactional topic's (the DLQ's, in exactly-once delivery) last offsets can be commit
    // markers, which are never delivered: the consumer's position moves past them, so a
    // partition is also done once its position reaches the end.
    if let Ok(positions) = consumer.position() {
        for e in positions.elements_for_topic(source) {
            if let (Offset::Offset(at), Some(&end)) = (e.offset(), open.get(&e.partition()))
                && at >= end
            {
                open.remove(&e.partition());
            }
        }
    }
}

/// A run's counts, and the tasks it copied, as its records are read and written.
struct Tally<'a> {
    mode: Mode,
    source: &'a str,
    summary: Summary,
    /// The identities of the tasks copied, so that each is written once.
    seen: HashSet<String>,
}

impl Tally<'_> {
    /// Counts a record read; the copy to write of it and its origin, when there is one.
    fn read(&mut self, p: i32, o: i64, copy: Option<Copy>, outcome: Outcome) -> Option<(Copy, String)> {
        self.summary.read += 1;
        match outcome {
            Outcome::Copy(identity) => {
                if !self.seen.insert(identity) {
                    self.summary.duplicates += 1;
                } else if self.summary.dry_run {
                    self.summary.written += 1;
                } else if let Some(copy) = copy {
                    let origin = format!("{}:{}:{p}:{o}", self.mode.name(), self.source);
                    return Some((copy, origin));
                }
            }
            Outcome::Filtered => self.summary.filtered += 1,
            Outcome::Unreadable => self.summary.unreadable += 1,
        }
        None
    }

    /// Counts a write acknowledged, or fails the run with how far it got.
    fn written(&mut self, done: Result<(), KafkaError>, topic: &str) -> Result<(), ReplayError> {
        done.map_err(|source| ReplayError::Write {
            topic: topic.to_owned(),
            written: self.summary.written,
            source,
        })?;
        self.summary.written += 1;
        Ok(())
    }
}

/// Writes the copies the reader sends to their lanes' topics, at most 256 awaiting
/// acknowledgement, until the reader is done and every write is acknowledged.
async fn write_all(
    producer: &FutureProducer,
    topics: &TaskTopics,
    mut rx: Receiver<Read>,
    tally: &mut Tally<'_>,
    progress: &impl Fn(&Summary),
) -> Result<(), ReplayError> {
    let mut reading = true;
    let mut pending = futures::stream::FuturesOrdered::new();
    loop {
        tokio::select! {
            biased;
            Some((done, topic)) = pending.next(), if !pending.is_empty() => {
                tally.written(done, topic)?;
                progress(&tally.summary);
            }
            item = rx.recv(), if reading && pending.len() < 256 => {
                let Some(item) = item else {
                    reading = false;
                    continue;
                };
                let (p, o, copy, outcome) = item?;
                if let Some((copy, origin)) = tally.read(p, o, copy, outcome) {
                    let topic = topics.of(copy.lane);
                    pending.push_back(async move { (write(producer, topic, copy, origin).await, topic) });
                }
                progress(&tally.summary);
            }
            else => break,
        }
    }
    while let Some((done, topic)) = pending.next().await {
        tally.written(done, topic)?;
    }
    Ok(())
}

enum Outcome {
    /// Copy it; the string identifies the task, so a run writes each task once.
    Copy(String),
    Filtered,
    Unreadable,
}

/// What to do with one record of the range.
fn select(mode: Mode, source: &str, m: &BorrowedMessage<'_>, filter: &Filter) -> (Option<Copy>, Outcome) {
    let value = m.payload().unwrap_or_default();
    let headers: Vec<(String, Option<Vec<u8>>)> = m
        .headers()
        .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
        .unwrap_or_default();
    match mode {
        Mode::Replay => {
            let task: Option<serde_json::Value> = serde_json::from_slice(value).ok();
            let field = |name: &str| task.as_ref().and_then(|t| t.get(name)).and_then(|v| v.as_str()).map(str::to_owned);
            let filtering = !filter.models.is_empty() || !filter.tenants.is_empty();
            if task.is_none() && filtering {
                return (None, Outcome::Unreadable);
            }
            let keep = |wanted: &[String], got: Option<String>| wanted.is_empty() || got.is_some_and(|g| wanted.contains(&g));
            if !keep(&filter.models, field("model")) || !keep(&filter.tenants, field("tenant")) {
                return (None, Outcome::Filtered);
            }
            let identity = field("task_id").unwrap_or_else(|| format!("{source}:{}:{}", m.partition(), m.offset()));
            let copy = Copy {
                key: m.key().map(<[u8]>::to_vec),
                value: value.to_vec(),
                headers,
                lane: lane_of(task.as_ref()),
            };
            (Some(copy), Outcome::Copy(identity))
        }
        Mode::Redrive => {
            let Ok(dlq) = serde_json::from_slice::<DlqRecord>(value) else {
                return (None, Outcome::Unreadable);
            };
            if !filter.reasons.is_empty() && !filter.reasons.contains(&dlq.reason) {
                return (None, Outcome::Filtered);
            }
            let (Ok(key), Ok(value), Ok(headers)) = (dlq.original.key(), dlq.original.value(), dlq.original.headers()) else {
                return (None, Outcome::Unreadable);
            };
            // The next delivery of the task: one more than the original record's (`attempts` of a
            // DLQ record counts the retries of one delivery, not deliveries).
            let attempt = attempt_of(headers.iter().find(|(k, _)| k == HEADER_ATTEMPT).and_then(|(_, v)| v.as_deref()));
            let mut headers: Vec<(String, Option<Vec<u8>>)> = headers.into_iter().filter(|(k, _)| k != HEADER_ATTEMPT).collect();
            headers.push((HEADER_ATTEMPT.to_owned(), Some((attempt + 1).to_string().into_bytes())));
            let identity = dlq
                .task_id
                .map(|t| t.to_string())
                .unwrap_or_else(|| format!("{}:{}:{}", dlq.source.topic, dlq.source.partition, dlq.source.offset));
            let lane = lane_of(serde_json::from_slice(&value).ok().as_ref());
            (Some(Copy { key, value, headers, lane }), Outcome::Copy(identity))
        }
    }
}

async fn write(producer: &FutureProducer, topic: &str, copy: Copy, origin: String) -> Result<(), KafkaError> {
    let headers = sluice_service::kafka::headers(
        copy.headers
            .iter()
            .filter(|(k, _)| k != HEADER_ORIGIN)
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .chain([(HEADER_ORIGIN, Some(origin.as_bytes()))]),
    );
    let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(&copy.value).headers(headers);
    if let Some(key) = &copy.key {
        record = record.key(key);
    }
    producer
        .send(record, rdkafka::util::Timeout::Never)
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_goes_to_the_lane_its_record_names() {
        let lane = |v: serde_json::Value| lane_of(Some(&v));
        assert_eq!(lane(serde_json::json!({"priority": "interactive"})), Priority::Interactive);
        assert_eq!(lane(serde_json::json!({"priority": "batch"})), Priority::Batch);
        assert_eq!(
            lane(serde_json::json!({"model": "terrain"})),
            Priority::Standard,
            "left out: standard"
        );
        assert_eq!(
            lane(serde_json::json!({"priority": "urgent"})),
            Priority::Standard,
            "unknown: the tasks topic"
        );
        assert_eq!(lane_of(None), Priority::Standard, "not a task record");
        let topics = TaskTopics::new("t", "t.i", "t.b");
        assert_eq!(topics.of(lane(serde_json::json!({"priority": "batch"}))), "t.b");
    }
}
