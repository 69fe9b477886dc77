//! Learned batch ceilings kept across restarts, in a compacted Kafka topic
//! (`sluice.ceilings.v1`, `SLUICE_CEILINGS_TOPIC`). A record's key is `{device class}|{bucket}`, its
//! value a [`CeilingRecord`]; a ceiling back at its maximum is forgotten with a tombstone, so
//! compaction keeps one record per bucket that ever ran out of memory. A worker reads the whole
//! topic once at start, keeps the entries of its own device class (the execution provider and
//! the memory it may use: a ceiling learned on one GPU type or arena cap is never applied to
//! another) and writes each change as it learns it. Workers of one device class share what they
//! learn; a stale entry costs one out-of-memory error, after which the bucket learns again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rdkafka::Offset;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};
use sluice_service::kafka::WholeTopics;

use crate::batching::adaptive::{CeilingStore, Learned};
use crate::engine::Device;
use crate::events::{CeilingsRestored, Emit};
use crate::metrics::Metrics;

/// Most ceilings kept per device class; records beyond are skipped (and counted).
pub const MAX_KEPT: usize = 4096;
/// Largest record read; a larger one is skipped.
const MAX_RECORD_BYTES: usize = 4096;
/// How long a starting worker reads the topic before it goes on with what it has.
const READ_FOR: Duration = Duration::from_secs(15);

/// One learned ceiling, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CeilingRecord {
    pub version: u32,
    pub device: String,
    pub bucket: String,
    #[serde(flatten)]
    pub learned: Learned,
    pub worker_id: String,
    pub at: DateTime<Utc>,
}

/// The device class ceilings are kept for: the execution provider and the memory a worker may
/// use there (CUDA: the device's total memory and `gpu_mem_limit`; CPU: the arena cap, or the
/// machine's memory without one).
pub fn device_class(device: &Device, cpu_arena_max_bytes: Option<usize>) -> String {
    match device {
        Device::Cuda { device_id, mem_limit, .. } => {
            let total =
                crate::engine::gpu::device_memory(*device_id).map_or("unknown".to_owned(), |(_, total)| format!("{}MiB", total >> 20));
            let limit = mem_limit.map_or("none".to_owned(), |l| l.to_string());
            format!("cuda:memory={total}:gpu_mem_limit={limit}")
        }
        Device::Cpu => match cpu_arena_max_bytes {
            Some(cap) => format!("cpu:arena={cap}"),
            None => format!("cpu:memory={}MiB", crate::metrics::total_memory_bytes().unwrap_or(0) >> 20),
        },
    }
}

/// The ceilings of this worker's device class, read from the topic at start, written back as
/// they change.
pub struct KafkaCeilings {
    topic: String,
    device: String,
    worker_id: String,
    producer: FutureProducer,
    known: Mutex<HashMap<String, Learned>>,
}

impl KafkaCeilings {
    /// Reads `topic` whole (blocking, at most [`READ_FOR`]) through `consumer`, a reader outside
    /// any group, and keeps the entries of `device`. A missing topic is a warning: ceilings are
    /// then learned again after every restart.
    pub fn load(
        consumer: BaseConsumer,
        producer: FutureProducer,
        topic: String,
        device: String,
        worker_id: String,
        metrics: &Metrics,
    ) -> KafkaCeilings {
        let (known, skipped) = read(&consumer, &topic, &device);
        CeilingsRestored {
            topic: &topic,
            device: &device,
            count: known.len(),
            skipped,
        }
        .emit(metrics);
        KafkaCeilings {
            topic,
            device,
            worker_id,
            producer,
            known: Mutex::new(known),
        }
    }

    fn key(&self, bucket: &str) -> String {
        format!("{}|{bucket}", self.device)
    }
}

/// The entries of `device` in `topic` (latest per key), and how many records were skipped.
fn read(consumer: &BaseConsumer, topic: &str, device: &str) -> (HashMap<String, Learned>, usize) {
    let mut known = HashMap::new();
    let mut skipped = 0;
    let mut whole = WholeTopics::new(vec![topic.to_owned()]);
    if let Err(e) = whole.refresh(consumer) {
        tracing::warn!(topic, error = %e, "reading the ceilings topic failed: learned ceilings start over");
        return (known, skipped);
    }
    if whole.partitions().is_empty() {
        tracing::warn!(
            topic,
            "the ceilings topic does not exist: learned ceilings start over after every restart"
        );
        return (known, skipped);
    }
    let mut ends = HashMap::new();
    for (t, p) in whole.partitions() {
        match consumer.fetch_watermarks(t, *p, Duration::from_secs(5)) {
            Ok((low, high)) if high > low => {
                ends.insert(*p, high);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(topic, partition = p, error = %e, "ceilings topic: no watermarks"),
        }
    }
    let deadline = Instant::now() + READ_FOR;
    while !ends.is_empty() && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let key = m.key().and_then(|k| std::str::from_utf8(k).ok()).unwrap_or_default();
                let Some(bucket) = key.strip_prefix(device).and_then(|k| k.strip_prefix('|')) else {
                    continue; // another device class
                };
                match m.payload() {
                    None => {
                        known.remove(bucket);
                    }
                    Some(p) => match parse(p, device, bucket) {
                        Some(learned) if known.len() < MAX_KEPT || known.contains_key(bucket) => {
                            known.insert(bucket.to_owned(), learned);
                        }
                        _ => skipped += 1,
                    },
                }
            }
            Some(Err(e)) => tracing::debug!(topic, error = %e, "ceilings topic: poll"),
            None => {}
        }
        if let Ok(positions) = consumer.position() {
            ends.retain(
                |p, high| !matches!(positions.find_partition(topic, *p).map(|e| e.offset()), Some(Offset::Offset(o)) if o >= *high),
            );
        }
    }
    if !ends.is_empty() {
        tracing::warn!(
            topic,
            "the ceilings topic was not read to its end in time: starting with what was read"
        );
    }
    (known, skipped)
}

/// A record's learned ceiling, if it is well formed and about `device` and `bucket`.
fn parse(payload: &[u8], device: &str, bucket: &str) -> Option<Learned> {
    if payload.len() > MAX_RECORD_BYTES {
        return None;
    }
    let record: CeilingRecord = serde_json::from_slice(payload).ok()?;
    let sane = record.version == 1
        && record.device == device
        && record.bucket == bucket
        && record.learned.limit >= 1
        && record.learned.part_rows.is_none_or(|r| r >= 1);
    sane.then_some(record.learned)
}

impl CeilingStore for KafkaCeilings {
    fn get(&self, bucket: &str) -> Option<Learned> {
        self.known.lock().expect("ceilings").get(bucket).copied()
    }

    fn put(&self, bucket: &str, learned: Option<Learned>) {
        {
            let mut known = self.known.lock().expect("ceilings");
            match learned {
                Some(l) if known.len() < MAX_KEPT || known.contains_key(bucket) => {
                    known.insert(bucket.to_owned(), l);
                }
                Some(_) => return, // bounded: this one is learned again after a restart
                None => {
                    if known.remove(bucket).is_none() {
                        return;
                    }
                }
            }
        }
        let key = self.key(bucket);
        let payload = learned.map(|learned| {
            serde_json::to_string(&CeilingRecord {
                version: 1,
                device: self.device.clone(),
                bucket: bucket.to_owned(),
                learned,
                worker_id: self.worker_id.clone(),
                at: Utc::now(),
            })
            .expect("serializable")
        });
        let mut record = FutureRecord::<str, str>::to(&self.topic).key(key.as_str());
        if let Some(p) = &payload {
            record = record.payload(p.as_str());
        }
        match self.producer.send_result(record) {
            Ok(delivery) => {
                let bucket = bucket.to_owned();
                tokio::spawn(async move {
                    if let Ok(Err((e, _))) = delivery.await {
                        tracing::warn!(bucket, error = %e, "keeping a learned ceiling failed; it is learned again after a restart");
                    }
                });
            }
            Err((e, _)) => tracing::warn!(bucket, error = %e, "keeping a learned ceiling failed; it is learned again after a restart"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_only_for_their_own_device_and_bucket() {
        let record = |device: &str, bucket: &str, limit: usize| {
            serde_json::to_vec(&CeilingRecord {
                version: 1,
                device: device.into(),
                bucket: bucket.into(),
                learned: Learned {
                    limit,
                    part_rows: None,
                    probe_backoff: 1,
                },
                worker_id: "w".into(),
                at: Utc::now(),
            })
            .unwrap()
        };
        let good = record("cpu:arena=1", "sd:256x256:euler:2:cfg:1", 2);
        assert_eq!(
            parse(&good, "cpu:arena=1", "sd:256x256:euler:2:cfg:1"),
            Some(Learned {
                limit: 2,
                part_rows: None,
                probe_backoff: 1
            })
        );
        assert_eq!(parse(&good, "cpu:arena=2", "sd:256x256:euler:2:cfg:1"), None, "another device");
        assert_eq!(parse(&good, "cpu:arena=1", "sd:512x512:euler:2:cfg:1"), None, "a key that lies");
        assert_eq!(parse(&record("cpu:arena=1", "b", 0), "cpu:arena=1", "b"), None, "limit 0");
        assert_eq!(parse(b"{\"version\":1}", "cpu:arena=1", "b"), None);
        assert_eq!(parse(&vec![b' '; MAX_RECORD_BYTES + 1], "cpu:arena=1", "b"), None);
        let text = String::from_utf8(good).unwrap();
        assert!(!text.contains("part_rows"), "absent unless learned: {text}");
    }

    #[test]
    fn device_classes_tell_arena_caps_apart() {
        assert_eq!(device_class(&Device::Cpu, Some(400_000_000)), "cpu:arena=400000000");
        assert_ne!(device_class(&Device::Cpu, Some(1)), device_class(&Device::Cpu, Some(2)));
        assert!(device_class(&Device::Cpu, None).starts_with("cpu:memory="));
    }
}
