//! Kafka client settings shared by the producer and the worker.

use clap::Args;
use rdkafka::ClientConfig;

/// Connection settings of any Sluice Kafka client.
#[derive(Debug, Clone, Args)]
pub struct KafkaClientArgs {
    /// Kafka bootstrap servers.
    #[arg(long = "kafka-brokers", env = "SLUICE_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Extra librdkafka properties, `key=value`, comma-separated (TLS, SASL, tuning). Applied
    /// after Sluice's own settings, so they can override them. Values (SASL passwords) are
    /// never printed: not in `--help`, not in errors, not in `Debug`.
    #[arg(
        long = "kafka-option",
        env = "SLUICE_KAFKA_OPTIONS",
        value_delimiter = ',',
        value_parser = KafkaOptionParser,
        hide_env_values = true
    )]
    pub options: Vec<KafkaOption>,
}

/// One extra librdkafka property. Its `Debug` shows the key only: values are often secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaOption {
    pub key: String,
    pub value: String,
}

impl std::fmt::Debug for KafkaOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}=<redacted>", self.key)
    }
}

impl KafkaOption {
    /// Parses `key=value`; the error never repeats the input (it may hold a password).
    pub fn parse(s: &str) -> Result<KafkaOption, &'static str> {
        let (k, v) = s.split_once('=').ok_or("expected key=value (the value is not shown)")?;
        if k.trim().is_empty() {
            return Err("empty key before '=' (the value is not shown)");
        }
        Ok(KafkaOption {
            key: k.trim().to_owned(),
            value: v.trim().to_owned(),
        })
    }
}

/// clap's own value errors quote the value; this parser's name the flag only.
#[derive(Clone)]
struct KafkaOptionParser;

impl clap::builder::TypedValueParser for KafkaOptionParser {
    type Value = KafkaOption;

    fn parse_ref(&self, _cmd: &clap::Command, arg: Option<&clap::Arg>, value: &std::ffi::OsStr) -> Result<KafkaOption, clap::Error> {
        let name = arg.map(|a| a.to_string()).unwrap_or_else(|| "--kafka-option".into());
        let fail = |why: &str| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("invalid {name}: {why}\n"));
        KafkaOption::parse(value.to_str().ok_or_else(|| fail("not UTF-8"))?).map_err(fail)
    }
}

/// Largest record Sluice produces (a DLQ record carries the original record, base64-encoded).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

/// The `content-type` header of Sluice's JSON records, with [`JSON`].
pub const CONTENT_TYPE: &str = "content-type";
/// The content type of Sluice's JSON records.
pub const JSON: &[u8] = b"application/json";

/// A record's headers from `(name, value)` pairs, in their order (a `None` value is a header
/// without one): the one place Sluice's records get their headers.
pub fn headers<'k, 'v>(pairs: impl IntoIterator<Item = (&'k str, Option<&'v [u8]>)>) -> rdkafka::message::OwnedHeaders {
    pairs.into_iter().fold(rdkafka::message::OwnedHeaders::new(), |h, (key, value)| {
        h.insert(rdkafka::message::Header { key, value })
    })
}

impl KafkaClientArgs {
    /// A client configuration with the bootstrap servers and `settings`, then the user's extra
    /// properties on top.
    pub fn config(&self, settings: &[(&str, &str)]) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (k, v) in settings {
            config.set(*k, *v);
        }
        for o in &self.options {
            config.set(&o.key, &o.value);
        }
        config
    }

    /// A producer that never loses or duplicates an acknowledged record: every in-sync replica
    /// acknowledges (`acks=all`), and retries are deduplicated by the broker (idempotence).
    ///
    /// `linger_ms` trades latency for fewer, larger produce requests (a broker's cost is mostly
    /// per request).
    pub fn producer_config(&self, client_id: &str, delivery_timeout_ms: u64, linger_ms: u32) -> ClientConfig {
        let timeout = delivery_timeout_ms.to_string();
        let max_bytes = MAX_MESSAGE_BYTES.to_string();
        let linger = linger_ms.to_string();
        self.config(&[
            ("client.id", client_id),
            ("acks", "all"),
            ("enable.idempotence", "true"),
            ("linger.ms", &linger),
            ("message.timeout.ms", &timeout),
            ("message.max.bytes", &max_bytes),
        ])
    }
}

/// How long a fetch of a consumer that runs all day (a worker's tasks and cancels) waits at the
/// broker for records: librdkafka's default. The broker answers a waiting fetch as soon as a
/// record arrives, so the wait adds nothing to how soon a record is read; it sets how often an
/// idle consumer asks again, and each fetch costs the broker CPU. Measured on the local Apache
/// Kafka 4.3.1: an idle worker fetching every 100 ms cost the broker 4–6 % of a core (~2 ms of
/// CPU per fetch), every 500 ms 0.7 %; tasks sent to an idle worker at 5 a second completed with
/// the same latency either way (p50 64–73 ms; `sluice-bench delivery`, `docs/benchmarks.md`).
pub const IDLE_FETCH_WAIT_MS: u32 = 500;

impl KafkaClientArgs {
    /// A consumer that reads whole topics itself ([`WholeTopics`]) rather than as a group
    /// member: the group id only names the client and never commits. Fetches answer within
    /// 100 ms — these readers serve people (task status): with librdkafka's 500 ms default the
    /// status view stayed seconds behind a running task on tansu, the Kafka-protocol stand-in the
    /// project ran on before Apache Kafka. A worker's cancels reader waits
    /// [`IDLE_FETCH_WAIT_MS`] instead ([`KafkaClientArgs::whole_topic_config_waiting`]).
    ///
    /// They read `read_committed` (librdkafka's default, set here so an override is deliberate):
    /// records of an aborted worker transaction are never shown, and a transaction's records
    /// appear together once it commits.
    pub fn whole_topic_config(&self, client: &str) -> ClientConfig {
        self.whole_topic_config_waiting(client, 100)
    }

    /// [`KafkaClientArgs::whole_topic_config`] whose fetches wait up to `fetch_wait_ms` at the
    /// broker: for a reader that follows a topic where records are rare (a worker's cancels),
    /// [`IDLE_FETCH_WAIT_MS`].
    pub fn whole_topic_config_waiting(&self, client: &str, fetch_wait_ms: u32) -> ClientConfig {
        let group = format!("{client}-{}", std::process::id());
        let wait = fetch_wait_ms.to_string();
        self.config(&[
            ("group.id", group.as_str()),
            ("isolation.level", "read_committed"),
            ("enable.auto.commit", "false"),
            ("enable.partition.eof", "false"),
            ("auto.offset.reset", "earliest"),
            ("fetch.wait.max.ms", wait.as_str()),
        ])
    }
}

/// Keeps a consumer assigned to every partition of some topics, outside any consumer group
/// (every replica reads everything): partitions that appear are read from their beginning (or
/// from where [`WholeTopics::starting_at`] says), the others keep their position.
pub struct WholeTopics {
    topics: Vec<String>,
    assigned: std::collections::BTreeSet<(String, i32)>,
    start: std::collections::HashMap<(String, i32), i64>,
}

impl WholeTopics {
    pub fn new(topics: Vec<String>) -> WholeTopics {
        WholeTopics {
            topics,
            assigned: Default::default(),
            start: Default::default(),
        }
    }

    /// Starts these partitions at these offsets (where an earlier run stopped) rather than at
    /// their beginning.
    pub fn starting_at(mut self, start: std::collections::HashMap<(String, i32), i64>) -> WholeTopics {
        self.start = start;
        self
    }

    /// Reads the topics' metadata and assigns any partition not assigned yet.
    pub fn refresh(&mut self, consumer: &rdkafka::consumer::BaseConsumer) -> rdkafka::error::KafkaResult<()> {
        use rdkafka::consumer::Consumer;
        use rdkafka::{Offset, TopicPartitionList};
        let mut found = self.assigned.clone();
        for name in &self.topics {
            let metadata = consumer.fetch_metadata(Some(name), std::time::Duration::from_secs(5))?;
            for t in metadata.topics() {
                found.extend(t.partitions().iter().map(|p| (t.name().to_owned(), p.id())));
            }
        }
        if found.len() == self.assigned.len() {
            return Ok(());
        }
        let positions = consumer.position().ok();
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &found {
            let offset = positions
                .as_ref()
                .and_then(|pos| pos.find_partition(topic, *partition).map(|e| e.offset()))
                .filter(|o| matches!(o, Offset::Offset(_)))
                .or_else(|| self.start.get(&(topic.clone(), *partition)).map(|o| Offset::Offset(*o)))
                .unwrap_or(Offset::Beginning);
            tpl.add_partition_offset(topic, *partition, offset)?;
        }
        consumer.assign(&tpl)?;
        self.assigned = found;
        Ok(())
    }

    /// Every partition assigned so far.
    pub fn partitions(&self) -> &std::collections::BTreeSet<(String, i32)> {
        &self.assigned
    }

    /// Every assigned partition's end now (its high watermark; 0 for an empty one): having read
    /// to all of them is being caught up with the topics. An error leaves none out: a
    /// partition left out would count as read.
    pub fn ends(&self, consumer: &rdkafka::consumer::BaseConsumer) -> rdkafka::error::KafkaResult<Vec<(String, i32, i64)>> {
        use rdkafka::consumer::Consumer;
        self.assigned
            .iter()
            .map(|(t, p)| {
                consumer
                    .fetch_watermarks(t, *p, std::time::Duration::from_secs(5))
                    .map(|(low, high)| (t.clone(), *p, if low == high { 0 } else { high }))
            })
            .collect()
    }

    /// Whether every one of `ends` is reached: by `read_to` (the next offset to read, as the
    /// caller counts it) or by the consumer's position (which also passes transaction markers).
    pub fn reached(
        consumer: &rdkafka::consumer::BaseConsumer,
        ends: &[(String, i32, i64)],
        read_to: impl Fn(&str, i32) -> Option<i64>,
    ) -> bool {
        use rdkafka::Offset;
        use rdkafka::consumer::Consumer;
        let Ok(positions) = consumer.position() else {
            return false;
        };
        ends.iter().all(|(topic, p, high)| {
            *high == 0
                || read_to(topic, *p).is_some_and(|n| n >= *high)
                || positions
                    .find_partition(topic, *p)
                    .is_some_and(|e| matches!(e.offset(), Offset::Offset(o) if o >= *high))
        })
    }
}

/// Task topics that the cluster does not have: a setup mistake, told at startup rather than as
/// records that never arrive (a worker) or publishes that time out (a producer).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "task topics missing on the cluster: {}; create them (docs/chart.md lists the topics) or point SLUICE_TASKS_TOPIC, SLUICE_INTERACTIVE_TOPIC and SLUICE_BATCH_TOPIC at existing ones",
    .0.join(", ")
)]
pub struct MissingTopics(pub Vec<String>);

/// How long [`check_topics`] waits for the cluster to say which topics it has.
const TOPIC_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Checks that every one of `topics` exists, with one metadata request for all topics (which
/// creates none, whatever the broker's auto-creation setting). Blocks. A cluster that does not
/// answer within 5 s passes: a client rides out a broker outage as it always does, and this check
/// is for topics the cluster says it does not have.
pub fn check_topics<C: rdkafka::ClientContext>(client: &rdkafka::client::Client<C>, topics: &[&str]) -> Result<(), MissingTopics> {
    let Ok(metadata) = client.fetch_metadata(None, TOPIC_CHECK_TIMEOUT) else {
        return Ok(());
    };
    let present: std::collections::HashSet<&str> = metadata.topics().iter().map(|t| t.name()).collect();
    missing(topics, &present)
}

fn missing(topics: &[&str], present: &std::collections::HashSet<&str>) -> Result<(), MissingTopics> {
    let absent: Vec<String> = topics.iter().filter(|t| !present.contains(**t)).map(|t| t.to_string()).collect();
    if absent.is_empty() { Ok(()) } else { Err(MissingTopics(absent)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_options_override_sluice_settings() {
        let args = KafkaClientArgs {
            brokers: "b:1".into(),
            options: vec![
                KafkaOption::parse("linger.ms=0").unwrap(),
                KafkaOption::parse("security.protocol=SASL_SSL").unwrap(),
            ],
        };
        let config = args.producer_config("c", 1000, 5);
        assert_eq!(config.get("linger.ms"), Some("0"));
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("security.protocol"), Some("SASL_SSL"));
    }

    #[test]
    fn headers_keep_their_order_and_values_even_absent_ones() {
        use rdkafka::message::Headers;
        let h = headers([("a", Some(&b"1"[..])), ("b", None), ("a", Some(&b"2"[..]))]);
        let got: Vec<(&str, Option<&[u8]>)> = h.iter().map(|h| (h.key, h.value)).collect();
        assert_eq!(got, vec![("a", Some(&b"1"[..])), ("b", None), ("a", Some(&b"2"[..]))]);
    }

    #[test]
    fn parses_key_values() {
        let o = KafkaOption::parse("a.b = c=d").unwrap();
        assert_eq!((o.key.as_str(), o.value.as_str()), ("a.b", "c=d"));
        assert!(KafkaOption::parse("nokey").is_err());
        assert!(KafkaOption::parse("=v").is_err());
    }

    /// A SASL password never reaches `Debug`, `--help` or a parse error.
    #[test]
    fn option_values_are_never_printed() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            kafka: KafkaClientArgs,
        }
        let ok = Cli::try_parse_from(["x", "--kafka-option", "sasl.password=hunter2"]).unwrap();
        assert!(!format!("{ok:?}").contains("hunter2"), "{ok:?}");
        assert_eq!(ok.kafka.options[0].value, "hunter2");
        let bad = Cli::try_parse_from(["x", "--kafka-option", "sasl.password:hunter2"]).unwrap_err();
        assert!(!bad.to_string().contains("hunter2"), "{bad}");
        assert!(bad.to_string().contains("--kafka-option"), "{bad}");
    }

    #[test]
    fn every_absent_topic_is_named() {
        let present = ["t", "t.i"].into_iter().collect();
        assert_eq!(missing(&["t", "t.i"], &present), Ok(()));
        let err = missing(&["t", "t.b", "t.x"], &present).unwrap_err();
        assert_eq!(err, MissingTopics(vec!["t.b".into(), "t.x".into()]));
        assert!(
            err.to_string().starts_with("task topics missing on the cluster: t.b, t.x;"),
            "{err}"
        );
    }
}
