//! The workers' backlog, measured from outside the workers: per partition of each task topic (the
//! tasks topic, and a lane's own where it has one: the backlog per lane), the
//! tasks the workers' consumer group has not committed (high watermark − committed offset) and how
//! long the oldest of them has waited (the timestamp of the record at the committed offset).
//!
//! Workers export their own lag too, but only while they run. This is what says that tasks wait
//! when no worker is up at all — what the backlog and stuck-consumer alerts read. The group's
//! offsets are read with an offset fetch, which does not join the group; nothing here commits.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use sluice_service::kafka::KafkaClientArgs;

use crate::events::{BacklogMeasured, Emit};
use crate::metrics::Metrics;

/// What to measure and how often.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The workers' consumer group.
    pub group: String,
    /// The task topics.
    pub topics: Vec<String>,
    pub interval: Duration,
}

/// One partition's backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Waiting {
    /// Where the group resumes (its committed offset, else the partition's start).
    from: i64,
    /// Tasks from there to the end.
    tasks: i64,
}

/// Starts measuring on a thread of its own; it runs until the process exits, logging failures
/// and trying again at the next interval.
pub fn start(kafka: &KafkaClientArgs, settings: Settings, metrics: Metrics) -> Result<(), KafkaError> {
    // Names the group only to fetch its offsets: never subscribes, assigns or commits.
    let offsets: BaseConsumer = kafka
        .config(&[
            ("group.id", settings.group.as_str()),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
        ])
        .create()?;
    let reader: BaseConsumer = kafka.whole_topic_config("sluice-backlog").create()?;
    std::thread::Builder::new()
        .name("backlog".into())
        .spawn(move || {
            loop {
                let started = Instant::now();
                for topic in &settings.topics {
                    match measure(&offsets, &reader, topic) {
                        Ok(partitions) => {
                            for (partition, (waiting, age)) in &partitions {
                                BacklogMeasured {
                                    topic,
                                    partition: *partition,
                                    tasks: waiting.tasks,
                                    oldest_seconds: *age,
                                }
                                .emit(&metrics);
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, topic, group = %settings.group, "measuring the backlog failed"),
                    }
                }
                std::thread::sleep(settings.interval.saturating_sub(started.elapsed()));
            }
        })
        .expect("spawning the backlog thread");
    Ok(())
}

/// Each partition's backlog and the age of its oldest waiting task, seconds.
fn measure(offsets: &BaseConsumer, reader: &BaseConsumer, topic: &str) -> Result<BTreeMap<i32, (Waiting, Option<f64>)>, KafkaError> {
    let timeout = Duration::from_secs(5);
    let metadata = offsets.fetch_metadata(Some(topic), timeout)?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition(topic, *p);
    }
    let committed = offsets.committed_offsets(tpl, timeout)?;
    let mut waiting = BTreeMap::new();
    for p in partitions {
        let (low, high) = offsets.fetch_watermarks(topic, p, timeout)?;
        let committed = committed.find_partition(topic, p).and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        });
        waiting.insert(p, backlog(committed, low, high));
    }
    let ages = oldest_ages(reader, topic, &waiting);
    Ok(waiting.into_iter().map(|(p, w)| (p, (w, ages.get(&p).copied()))).collect())
}

/// A partition's backlog: from the committed offset (else the start, where a new group begins)
/// to the high watermark.
fn backlog(committed: Option<i64>, low: i64, high: i64) -> Waiting {
    let from = committed.unwrap_or(low).clamp(low, high);
    Waiting { from, tasks: high - from }
}

/// Reads the first waiting record of each partition with a backlog; its timestamp gives the age.
fn oldest_ages(reader: &BaseConsumer, topic: &str, waiting: &BTreeMap<i32, Waiting>) -> BTreeMap<i32, f64> {
    let mut ages = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for (p, w) in waiting.iter().filter(|(_, w)| w.tasks > 0) {
        if tpl.add_partition_offset(topic, *p, Offset::Offset(w.from)).is_err() {
            return ages;
        }
    }
    if tpl.count() == 0 {
        return ages;
    }
    if let Err(e) = reader.assign(&tpl) {
        tracing::warn!(error = %e, "assigning the backlog reader failed");
        return ages;
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while ages.len() < tpl.count() && Instant::now() < deadline {
        let Some(Ok(m)) = reader.poll(Duration::from_millis(100)) else {
            continue;
        };
        let wanted = waiting.get(&m.partition()).is_some_and(|w| w.from == m.offset());
        if wanted && let Some(ms) = m.timestamp().to_millis() {
            let age = (chrono::Utc::now().timestamp_millis() - ms).max(0) as f64 / 1000.0;
            ages.insert(m.partition(), age);
        }
    }
    ages
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backlog_runs_from_the_committed_offset_or_the_start_to_the_end() {
        assert_eq!(backlog(Some(40), 0, 100), Waiting { from: 40, tasks: 60 });
        assert_eq!(backlog(None, 10, 100), Waiting { from: 10, tasks: 90 });
        assert_eq!(backlog(Some(100), 0, 100), Waiting { from: 100, tasks: 0 });
        // Committed below what retention kept: the group resumes at the start.
        assert_eq!(backlog(Some(3), 10, 100), Waiting { from: 10, tasks: 90 });
    }
}
