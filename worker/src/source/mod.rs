//! Reading the tasks topic. The consumer is polled on its own OS thread, so long inference never
//! blocks polling (no member is kicked for exceeding `max.poll.interval.ms`). Backpressure pauses
//! the assigned partitions when too many tasks are in flight and resumes them when half have
//! finished. Rebalance callbacks run on this thread: on a revoke, in-flight tasks of the revoked
//! partitions get up to the drain timeout to finish, then what is done is committed (in the
//! worker's delivery mode: [`crate::source::commit`]).

pub(crate) mod cancellations;
pub(crate) mod commit;
pub(crate) mod crash_guard;
pub(crate) mod done_ahead;
pub(crate) mod offset_list;
pub(crate) mod offsets;
pub(crate) mod orphans;
pub(crate) mod record;
pub(crate) mod redelivery;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientContext, TopicPartitionList};
use sluice_service::backpressure::Backpressure;
use sluice_service::kafka_failure;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::events::{Emit, LagObserved, PartitionsAssigned, PartitionsRevoked, Paused, PollGap, RebalanceFailed, RecordReceived};
use crate::metrics::Metrics;
use crate::source::commit::Committer;
use crate::source::offsets::{Offsets, TopicPartition};
use crate::source::record::{Origin, Record};

/// Consumer callbacks: rebalances, statistics (for lag).
pub(crate) struct SourceContext {
    offsets: Arc<Offsets>,
    committer: Arc<Committer>,
    metrics: Metrics,
    drain_timeout: Duration,
    paused: AtomicBool,
    topic: String,
}

impl SourceContext {
    pub(crate) fn new(
        offsets: Arc<Offsets>,
        committer: Arc<Committer>,
        metrics: Metrics,
        drain_timeout: Duration,
        topic: String,
    ) -> SourceContext {
        SourceContext {
            offsets,
            committer,
            metrics,
            drain_timeout,
            paused: AtomicBool::new(false),
            topic,
        }
    }
}

pub(crate) type TaskConsumer = BaseConsumer<SourceContext>;

fn partitions_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| TopicPartition {
            topic: e.topic().into(),
            partition: e.partition(),
        })
        .collect()
}

/// The consumer reads the read leases back from its group's commits.
impl crate::source::redelivery::CommittedMetadata for TaskConsumer {
    fn committed_metadata(&self, tp: &TopicPartition, timeout: Duration) -> Result<String, String> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&tp.topic, tp.partition);
        let committed = self.committed_offsets(tpl, timeout).map_err(|e| e.to_string())?;
        let element = committed.find_partition(&tp.topic, tp.partition);
        Ok(element.map(|e| e.metadata().to_owned()).unwrap_or_default())
    }
}

impl ClientContext for SourceContext {
    fn stats(&self, statistics: Statistics) {
        let Some(topic) = statistics.topics.get(&self.topic) else { return };
        let committed = self.offsets.committed_offsets();
        for (tp, committed) in committed {
            let Some(p) = topic.partitions.get(&tp.partition) else { continue };
            if p.hi_offset < 0 {
                continue;
            }
            let base = committed.unwrap_or(if p.committed_offset >= 0 {
                p.committed_offset
            } else {
                p.lo_offset.max(0)
            });
            LagObserved {
                topic: &tp.topic,
                partition: tp.partition,
                lag: (p.hi_offset - base).max(0),
            }
            .emit(&self.metrics);
        }
    }
}

impl ConsumerContext for SourceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let partitions = partitions_of(tpl);
            let started = Instant::now();
            let abandoned = self.offsets.wait_drained(&partitions, self.drain_timeout);
            let (commits, committed) = self.committer.commit_revoked(consumer, &self.offsets, &partitions);
            let commits: Vec<(i32, i64)> = commits.iter().map(|c| (c.tp.partition, c.offset)).collect();
            PartitionsRevoked {
                topic: &self.topic,
                partitions: &partitions.iter().map(|p| p.partition).collect::<Vec<_>>(),
                assigned_now: self.offsets.assigned().len(),
                drained: started.elapsed(),
                abandoned,
                commits: &commits,
                commit_error: committed.err().map(|e| e.to_string()),
            }
            .emit(&self.metrics);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let partitions = partitions_of(tpl);
                self.offsets.assign(&partitions);
                if self.paused.load(Ordering::SeqCst) {
                    let _ = consumer.pause(tpl);
                }
                PartitionsAssigned {
                    partitions: &partitions.iter().map(|p| p.partition).collect::<Vec<_>>(),
                    assigned_now: self.offsets.assigned().len(),
                }
                .emit(&self.metrics);
            }
            Rebalance::Error(e) => RebalanceFailed { error: &e.to_string() }.emit(&self.metrics),
            Rebalance::Revoke(_) => {}
        }
    }
}

/// Signals to the poll thread.
#[derive(Clone)]
pub(crate) struct SourceControl {
    /// Stop reading: pause everything and close the channel into the pipeline.
    pub stop_reading: CancellationToken,
    /// Leave: commit what is finished and leave the group.
    pub close: CancellationToken,
    /// Set by the poll loop when the consumer failed for good: the worker exits (crash-only)
    /// and its supervisor starts it again.
    pub fatal: CancellationToken,
}

/// The poll loop. Runs until `control.close`; then commits and leaves the group.
pub(crate) fn poll_loop(
    consumer: Arc<TaskConsumer>,
    offsets: Arc<Offsets>,
    tx: mpsc::Sender<Record>,
    control: SourceControl,
    max_in_flight: usize,
    metrics: Metrics,
) {
    let mut tx = Some(tx);
    let mut last_error_log: Option<Instant> = None;
    let mut backpressure = Backpressure::new(max_in_flight);
    let mut last_poll = Instant::now();
    while !control.close.is_cancelled() {
        PollGap { gap: last_poll.elapsed() }.emit(&metrics);
        last_poll = Instant::now();
        if tx.is_some() && control.stop_reading.is_cancelled() {
            tx = None; // closes the pipeline's input: the stages drain and end
            tracing::info!("stopped reading new tasks");
        }
        let in_flight = offsets.in_flight();
        // Stopping: paused for good (nothing read now would be tracked).
        let counted = if tx.is_none() { usize::MAX } else { in_flight };
        if let Some(pause) = backpressure.update(counted) {
            set_paused(&consumer, &metrics, pause, in_flight);
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            // librdkafka's consumer is unusable after a fatal error; one seen here: a KIP-848
            // static member restarted before its previous instance's session expired
            // (UNRELEASED_INSTANCE_ID).
            Some(Err(e)) if kafka_failure::classify(&e).ends_client() => {
                let failure = kafka_failure::classify(&e);
                tracing::error!(error = %e, %failure, "the Kafka consumer failed for good; the worker exits");
                control.fatal.cancel();
                break;
            }
            Some(Err(e)) if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) => {
                tracing::warn!(error = %e, "consumer error");
                last_error_log = Some(Instant::now());
            }
            Some(Err(_)) => {}
            Some(Ok(message)) => {
                let Some(sender) = &tx else { continue }; // stopping: not tracked, read again later
                let tp = TopicPartition {
                    topic: message.topic().into(),
                    partition: message.partition(),
                };
                let Some(origin) = offsets.track(&tp, message.offset()) else {
                    continue;
                };
                RecordReceived.emit(&metrics);
                if sender.blocking_send(record_of(origin, &message)).is_err() {
                    tracing::warn!("pipeline input closed");
                    tx = None;
                }
            }
        }
    }
    leave(&consumer);
}

/// Pauses or resumes fetching from every assigned partition.
fn set_paused(consumer: &TaskConsumer, metrics: &Metrics, pause: bool, in_flight: usize) {
    consumer.context().paused.store(pause, Ordering::SeqCst);
    Paused { paused: pause, in_flight }.emit(metrics);
    if let Ok(assignment) = consumer.assignment() {
        let r = if pause {
            consumer.pause(&assignment)
        } else {
            consumer.resume(&assignment)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, pause, "pause/resume failed");
        }
    }
}

/// A message read, as the pipeline's record of it.
fn record_of(origin: Origin, message: &BorrowedMessage<'_>) -> Record {
    let headers = message
        .headers()
        .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect())
        .unwrap_or_default();
    Record {
        origin,
        key: message.key().map(<[u8]>::to_vec),
        value: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers,
        timestamp_ms: message.timestamp().to_millis(),
        received_at: Instant::now(),
    }
}

/// Leaves the group; the revoke callback runs during the following polls and commits what is
/// finished (the caller bounds how long it waits for this thread).
fn leave(consumer: &TaskConsumer) {
    consumer.unsubscribe();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && consumer.assignment().map(|a| a.count() > 0).unwrap_or(false) {
        let _ = consumer.poll(Duration::from_millis(100));
    }
}
