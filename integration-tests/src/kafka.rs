//! Reading and writing topics directly, as outside clients do.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// One record as read.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: HashMap<String, Vec<u8>>,
    /// When this reader received it (benchmarks time visibility with it).
    pub received: Instant,
}

impl Consumed {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.value).unwrap_or(serde_json::Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

/// The values of header `name` on the records of `topic` keyed `key`, in topic order.
pub fn header_values(brokers: &str, topic: &str, key: &str, name: &str) -> anyhow::Result<Vec<String>> {
    Ok(TopicReader::snapshot(brokers, topic, Duration::from_secs(2))?
        .into_iter()
        .filter(|r| r.key.as_deref() == Some(key.as_bytes()))
        .filter_map(|r| r.header(name))
        .collect())
}

/// Creates topics (an admin request; those that exist are left as they are).
pub fn create_topics(brokers: &str, topics: &[(&str, u32)]) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", brokers).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, partitions)| NewTopic::new(name, *partitions as i32, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = futures::executor::block_on(admin.create_topics(&new, &options))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    Ok(())
}

/// Creates a one-partition topic that keeps the latest record per key (cleanup.policy=compact),
/// as `scripts/stack.sh` creates the ceilings topic; one that exists is left as it is.
pub fn create_compacted_topic(brokers: &str, name: &str) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", brokers).create()?;
    let topic = NewTopic::new(name, 1, TopicReplication::Fixed(1)).set("cleanup.policy", "compact");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    match futures::executor::block_on(admin.create_topics([&topic], &options))?.remove(0) {
        Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => Ok(()),
        Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
    }
}

/// Which records a reader sees: `read_committed` leaves out those of aborted transactions (and
/// waits for open ones), `read_uncommitted` sees every record written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    ReadCommitted,
    ReadUncommitted,
}

impl Isolation {
    fn name(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::ReadUncommitted => "read_uncommitted",
        }
    }
}

/// Reads every partition of a topic from the beginning, without a consumer group (nothing is
/// committed, so readers never disturb each other or the workers).
pub struct TopicReader {
    consumer: BaseConsumer,
    pub records: Vec<Consumed>,
}

impl TopicReader {
    /// A `read_committed` reader, as event-driven clients are.
    pub fn new(brokers: &str, topic: &str) -> anyhow::Result<TopicReader> {
        TopicReader::with_isolation(brokers, topic, Isolation::ReadCommitted)
    }

    pub fn with_isolation(brokers: &str, topic: &str, isolation: Isolation) -> anyhow::Result<TopicReader> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "100")
            .set("isolation.level", isolation.name())
            .create()?;
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        let partitions = metadata.topics().first().map(|t| t.partitions().len()).unwrap_or(0);
        anyhow::ensure!(partitions > 0, "topic {topic} has no partitions");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions as i32 {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        Ok(TopicReader {
            consumer,
            records: Vec::new(),
        })
    }

    /// Every record on `topic` now: what arrives within `settle`. Blocks (in place, when called
    /// from a multi-threaded runtime).
    pub fn snapshot(brokers: &str, topic: &str, settle: Duration) -> anyhow::Result<Vec<Consumed>> {
        tokio::task::block_in_place(|| {
            let mut reader = TopicReader::new(brokers, topic)?;
            reader.poll_for(settle);
            Ok(reader.records)
        })
    }

    /// Reads what arrives within `duration`.
    pub fn poll_for(&mut self, duration: Duration) -> &[Consumed] {
        let start = self.records.len();
        let deadline = Instant::now() + duration;
        while Instant::now() < deadline {
            if let Some(Ok(m)) = self.consumer.poll(Duration::from_millis(50)) {
                self.records.push(Consumed {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    value: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    headers: m
                        .headers()
                        .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec())).collect())
                        .unwrap_or_default(),
                    received: Instant::now(),
                });
            }
        }
        &self.records[start..]
    }

    /// Reads until `done(all records so far)` holds, or fails after `timeout`. `done` sees the
    /// whole list: for large reads use [`TopicReader::read_each`].
    pub fn read_until(&mut self, timeout: Duration, mut done: impl FnMut(&[Consumed]) -> bool) -> anyhow::Result<&[Consumed]> {
        let deadline = Instant::now() + timeout;
        while !done(&self.records) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "timed out after {timeout:?} ({} records read)",
                self.records.len()
            );
            self.poll_for(Duration::from_millis(200));
        }
        Ok(&self.records)
    }

    /// Hands each record to `on_record` once, as it arrives, until it returns true, or fails
    /// after `timeout`.
    pub fn read_each(&mut self, timeout: Duration, mut on_record: impl FnMut(&Consumed) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut next = 0;
        loop {
            while next < self.records.len() {
                next += 1;
                if on_record(&self.records[next - 1]) {
                    return Ok(());
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "timed out after {timeout:?} ({} records read)",
                self.records.len()
            );
            self.poll_for(Duration::from_millis(200));
        }
    }
}

/// Produces one record as is (acks=all), returning its partition and offset.
pub async fn produce_raw(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<(i32, i64)> {
    produce_to(producer, topic, None, key, value, headers).await
}

/// [`produce_raw`] to `partition` (`None`: the partitioner's choice, by key).
pub async fn produce_to(
    producer: &FutureProducer,
    topic: &str,
    partition: Option<i32>,
    key: Option<&[u8]>,
    value: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<(i32, i64)> {
    let headers = sluice_service::kafka::headers(headers.iter().map(|(k, v)| (*k, Some(*v))));
    let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(value).headers(headers);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Some(partition) = partition {
        record = record.partition(partition);
    }
    let delivery = producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    Ok((delivery.partition, delivery.offset))
}

/// The offset `group` committed for `partition` of `topic`, if any (an offset fetch; the reader
/// does not join the group).
pub fn committed(brokers: &str, group: &str, topic: &str, partition: i32) -> Option<i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .ok()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(10)).ok()?;
    match committed.find_partition(topic, partition)?.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// A producer for tests.
pub fn producer(brokers: &str) -> anyhow::Result<FutureProducer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("message.max.bytes", "33554432")
        .set("linger.ms", "2")
        .create()?)
}
