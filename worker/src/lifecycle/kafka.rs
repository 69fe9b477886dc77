//! Starting role two: the Kafka clients. The task consumer (its group settings), the producer of
//! progress and at-least-once outcomes, the transactional producers and committer of exactly-once
//! delivery, and the readers of the whole ceilings and control topics.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use sluice_service::transaction_producer::TransactionProducer;

use super::{Setup, StartError};
use crate::config::{Config, DeliveryMode, GroupProtocol};
use crate::source::cancellations::Cancellations;
use crate::source::commit::{Committer, Outbox, Transactional};
use crate::source::offsets::Offsets;
use crate::source::{SourceContext, TaskConsumer};
use crate::storage::ceilings::{KafkaCeilings, device_class};

/// The worker's connections to Kafka, and the offsets they commit.
pub(super) struct Clients {
    /// Progress records (and, at least once, outcomes) go out at once on this producer.
    pub producer: FutureProducer,
    pub committer: Arc<Committer>,
    /// Outcome records of exactly-once delivery, waiting for their transaction.
    pub outbox: Arc<Outbox>,
    pub offsets: Arc<Offsets>,
    pub consumer: Arc<TaskConsumer>,
}

/// Maps a client error to the start error that says what was being done.
fn failed(what: &'static str) -> impl Fn(KafkaError) -> StartError {
    move |source| StartError::Kafka { what, source }
}

impl Clients {
    /// Creates the clients and subscribes to the task topics, a lane's own among them (the group
    /// is joined by the first poll). `fatal` fires if exactly-once delivery is fenced.
    pub(super) async fn connect(setup: &Setup<'_>) -> Result<Clients, StartError> {
        let Setup {
            config,
            worker_id,
            metrics,
            fatal,
        } = *setup;
        let k = &config.kafka;
        let d = &config.delivery;
        let task_topics = k.task_topics();
        let topics = task_topics.all();
        let producer: FutureProducer = k
            .client
            .producer_config(worker_id, 30_000, 20)
            .create()
            .map_err(failed("creating the Kafka producer"))?;
        let outbox = Arc::new(Outbox::default());
        let committer = Arc::new(match d.delivery {
            DeliveryMode::AtLeastOnce => Committer::at_least_once(),
            DeliveryMode::ExactlyOnce => Committer::exactly_once(Transactional::new(
                transactional_producers(config, worker_id).await?,
                outbox.clone(),
                fatal.clone(),
            )),
        });
        let offsets = Arc::new(Offsets::new());
        let context = SourceContext::new(
            offsets.clone(),
            committer.clone(),
            metrics.clone(),
            d.drain_timeout(),
            task_topics.names(),
        );
        let settings = consumer_settings(config, worker_id);
        let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let consumer: Arc<TaskConsumer> = Arc::new(
            k.client
                .config(&settings)
                .create_with_context(context)
                .map_err(failed("creating the Kafka consumer"))?,
        );
        let (checking, names) = (consumer.clone(), task_topics.clone());
        tokio::task::spawn_blocking(move || sluice_service::kafka::check_topics(checking.client(), &names.all()))
            .await
            .expect("the topic check does not panic")?;
        consumer.subscribe(&topics).map_err(failed("subscribing to the task topics"))?;
        Ok(Clients {
            producer,
            committer,
            outbox,
            offsets,
            consumer,
        })
    }

    /// The learned batch ceilings of this worker's device class, read from the whole ceilings
    /// topic; `None` when `SLUICE_CEILINGS_TOPIC` is empty (nothing is kept).
    pub(super) async fn ceilings(&self, setup: &Setup<'_>) -> Result<Option<KafkaCeilings>, StartError> {
        let Setup {
            config,
            worker_id,
            metrics,
            ..
        } = *setup;
        let k = &config.kafka;
        if k.ceilings_topic.is_empty() {
            return Ok(None);
        }
        let consumer: BaseConsumer = k
            .client
            .whole_topic_config(&format!("{worker_id}-ceilings"))
            .create()
            .map_err(failed("creating the ceilings-topic consumer"))?;
        let (producer, topic, worker_id, metrics) = (
            self.producer.clone(),
            k.ceilings_topic.clone(),
            worker_id.to_owned(),
            metrics.clone(),
        );
        let e = &config.engine;
        let device = device_class(&e.device.session_options().device, e.device.runtime_options().cpu_arena_max_bytes);
        let store = tokio::task::spawn_blocking(move || KafkaCeilings::load(consumer, producer, topic, device, worker_id, &metrics))
            .await
            .expect("reading the ceilings topic does not panic");
        Ok(Some(store))
    }
}

/// Tasks cancelled by their clients, followed on the whole control topic by a thread of its own;
/// each cancel kept for `keep` (the longest a task may wait).
pub(super) fn cancellations(config: &Config, worker_id: &str, keep: Duration) -> Result<Cancellations, StartError> {
    let k = &config.kafka;
    let cancellations = Cancellations::new(keep);
    let consumer: BaseConsumer = k
        .client
        .whole_topic_config_waiting(&format!("{worker_id}-control"), sluice_service::kafka::IDLE_FETCH_WAIT_MS)
        .create()
        .map_err(failed("creating the control-topic consumer"))?;
    cancellations
        .follow(consumer, k.control_topic.clone())
        .map_err(|e| StartError::Model(format!("starting the control-topic reader: {e}")))?;
    Ok(cancellations)
}

/// The workers' assignor under the classic protocol; the member that repairs orphaned partitions
/// joins with it too (a member offering another is refused by the group).
const CLASSIC_ASSIGNOR: &str = "cooperative-sticky";

/// The task consumer's settings beside the client's own (brokers, security).
fn consumer_settings(config: &Config, worker_id: &str) -> Vec<(&'static str, String)> {
    let k = &config.kafka;
    let max_poll_interval = (config.delivery.drain_timeout().as_millis() as u64 + 20_000).max(30_000);
    let mut settings: Vec<(&'static str, String)> = vec![
        ("group.id", k.group_id.clone()),
        ("client.id", worker_id.to_owned()),
        ("enable.auto.commit", "false".into()),
        ("enable.auto.offset.store", "false".into()),
        ("auto.offset.reset", "earliest".into()),
        // The poll thread never waits on inference or storage; the longest it blocks is a
        // revoke's drain plus its commit. This is also how long a rebalance waits for members
        // that are gone, so keep it short.
        ("max.poll.interval.ms", max_poll_interval.to_string()),
        // Long-poll fetches, answered as soon as a task arrives (see IDLE_FETCH_WAIT_MS).
        ("fetch.wait.max.ms", sluice_service::kafka::IDLE_FETCH_WAIT_MS.to_string()),
        ("statistics.interval.ms", "5000".into()),
        // librdkafka prefetches up to 64 MB per partition by default; the worker bounds its own
        // queue (SLUICE_MAX_IN_FLIGHT), so a smaller prefetch bounds memory under floods of
        // large records without slowing steady consumption.
        ("queued.max.messages.kbytes", "16384".into()),
    ];
    match k.group_protocol {
        GroupProtocol::Classic => settings.extend([
            ("partition.assignment.strategy", CLASSIC_ASSIGNOR.into()),
            ("session.timeout.ms", "10000".into()),
            ("heartbeat.interval.ms", "1000".into()),
        ]),
        // Session and heartbeat are the broker's settings under KIP-848, and it assigns.
        GroupProtocol::Consumer => settings.push(("group.protocol", "consumer".into())),
    }
    if let Some(instance) = &k.group_instance_id {
        settings.push(("group.instance.id", instance.clone()));
        if k.group_protocol == GroupProtocol::Consumer {
            // Measured (sluice-bench group, the chaos suite): a KIP-848 static member that leaves
            // keeps its partitions until its session expires (10 s of stop on a scale-down), and
            // one restarted after kill -9 is fenced (UNRELEASED_INSTANCE_ID, fatal) until then.
            tracing::warn!(
                "SLUICE_GROUP_PROTOCOL=consumer with SLUICE_GROUP_INSTANCE_ID: a leaving worker's partitions wait out its session, and a restarted one exits until that session expires; leave SLUICE_GROUP_INSTANCE_ID unset with the consumer protocol"
            );
        }
    }
    settings
}

/// The settings of the short-lived member that makes the group rebalance when partitions are
/// orphaned (`source::orphans`): the group, no static identity, the workers' assignor; `None`
/// where that repair does not run (KIP-848, or `SLUICE_REPAIR_ORPHANS=false`).
pub(super) fn orphan_repair_member(config: &Config, worker_id: &str) -> Option<rdkafka::ClientConfig> {
    let k = &config.kafka;
    if k.group_protocol != GroupProtocol::Classic || !k.repair_orphans {
        return None;
    }
    let client_id = format!("{worker_id}-rebalance");
    Some(k.client.config(&[
        ("group.id", k.group_id.as_str()),
        ("client.id", client_id.as_str()),
        ("enable.auto.commit", "false"),
        ("enable.auto.offset.store", "false"),
        ("partition.assignment.strategy", CLASSIC_ASSIGNOR),
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "1000"),
        ("fetch.wait.max.ms", "100"),
        ("queued.max.messages.kbytes", "1024"),
    ]))
}

/// How long a transaction may stay open: the longest a worker killed mid-transaction, and not
/// restarted under the same identity, holds back `read_committed` readers of its partitions.
/// Long enough to ride out a broker restart (~7 s measured here) without aborting.
const TRANSACTION_TIMEOUT_MS: u64 = 15_000;

/// The producers of exactly-once delivery, which take turns ([`Transactional`]), their
/// transactions initialized: the transactional ids [`Config::transactional_id`] and the same
/// with `.2` appended. Previous instances with those ids are fenced and their open transactions
/// aborted.
async fn transactional_producers(config: &Config, worker_id: &str) -> Result<[TransactionProducer; 2], StartError> {
    let id = config.transactional_id();
    let (first, second) = tokio::try_join!(
        transactional_producer(config, worker_id, id.clone()),
        transactional_producer(config, worker_id, format!("{id}.2")),
    )?;
    Ok([first, second])
}

/// One producer of exactly-once delivery with transactional id `id`, its transactions
/// initialized.
async fn transactional_producer(config: &Config, worker_id: &str, id: String) -> Result<TransactionProducer, StartError> {
    let settings = config
        .kafka
        .client
        // A record not delivered within the transaction's lifetime fails it (librdkafka requires
        // message.timeout.ms <= transaction.timeout.ms); the committer aborts and retries.
        // No linger: a transaction's commit waits for every record it holds, so records held
        // back to fill a batch only hold the commit back.
        .producer_config(worker_id, TRANSACTION_TIMEOUT_MS, 0)
        .set("transactional.id", &id)
        // An open transaction of a worker that died holds back read_committed readers until
        // it is aborted: by the same identity's next start, or after this long.
        .set("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS.to_string())
        // A producer's next transaction may reach the coordinator while it still writes the
        // previous one's markers (taking turns makes that rare), and is answered
        // CONCURRENT_TRANSACTIONS; librdkafka retries after retry.backoff.ms, 100 ms by default
        // — with one producer, a tenth of a second added to every transaction (measured:
        // completion latency p50 196 ms against 57 ms at-least-once). 10 ms, doubling up to the
        // 1 s maximum.
        .set("retry.backoff.ms", "10")
        .clone();
    let producer = TransactionProducer::create(&settings).map_err(failed("creating the transactional producer"))?;
    let producer = tokio::task::spawn_blocking(move || producer.init_transactions(Duration::from_secs(30)).map(|()| producer))
        .await
        .map_err(|e| StartError::Model(format!("initializing transactions: {e}")))?
        .map_err(failed("initializing transactions (SLUICE_DELIVERY=exactly-once)"))?;
    tracing::info!(transactional_id = id, "exactly-once delivery: transactions initialized");
    Ok(producer)
}
