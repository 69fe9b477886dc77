//! Reading the task topics (the tasks topic, and each lane's own where it has one). The consumer
//! is polled on its own OS thread, so long inference never blocks polling (no member is kicked for
//! exceeding `max.poll.interval.ms`). Backpressure pauses a topic's assigned partitions when too
//! many of its tasks are in flight and resumes them when half have finished. Rebalance callbacks run on this thread: on a revoke, in-flight tasks of the revoked
//! partitions get up to the drain timeout to finish, then what is done is committed (in the
//! worker's delivery mode: [`crate::source::commit`]).

pub(crate) mod cancellations;
pub(crate) mod commit;
pub(crate) mod crash_guard;
pub(crate) mod done_ahead;
pub(crate) mod offset_list;
pub(crate) mod offsets;
pub(crate) mod orphans;
mod poll;
pub(crate) mod record;
pub(crate) mod redelivery;

pub(crate) use poll::{SourceControl, poll_loop};

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientContext, TopicPartitionList};

use crate::events::{Emit, LagObserved, PartitionsAssigned, PartitionsRevoked, RebalanceFailed};
use crate::metrics::Metrics;
use crate::source::commit::Committer;
use crate::source::offsets::{Offsets, TopicPartition};

/// Consumer callbacks: rebalances, statistics (for lag).
pub(crate) struct SourceContext {
    offsets: Arc<Offsets>,
    committer: Arc<Committer>,
    metrics: Metrics,
    drain_timeout: Duration,
    /// Task topics paused for backpressure: a partition of one assigned now starts paused.
    paused: Mutex<BTreeSet<String>>,
    /// The task topics read, one per lane with a topic of its own.
    topics: Vec<String>,
}

impl SourceContext {
    pub(crate) fn new(
        offsets: Arc<Offsets>,
        committer: Arc<Committer>,
        metrics: Metrics,
        drain_timeout: Duration,
        topics: Vec<String>,
    ) -> SourceContext {
        SourceContext {
            offsets,
            committer,
            metrics,
            drain_timeout,
            paused: Mutex::new(BTreeSet::new()),
            topics,
        }
    }

    fn paused(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

/// `(topic, partition)` of each, as events name them.
fn named(partitions: &[TopicPartition]) -> Vec<(&str, i32)> {
    partitions.iter().map(|tp| (&*tp.topic, tp.partition)).collect()
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
        let committed = self.offsets.committed_offsets();
        for (tp, committed) in committed {
            let Some(topic) = statistics.topics.get(&*tp.topic) else { continue };
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
            let commits: Vec<(&str, i32, i64)> = commits.iter().map(|c| (&*c.tp.topic, c.tp.partition, c.offset)).collect();
            PartitionsRevoked {
                partitions: &named(&partitions),
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
                let paused = self.paused();
                if !paused.is_empty() {
                    let mut pause = TopicPartitionList::new();
                    for tp in partitions.iter().filter(|tp| paused.contains(&*tp.topic)) {
                        pause.add_partition(&tp.topic, tp.partition);
                    }
                    let _ = consumer.pause(&pause);
                }
                drop(paused);
                PartitionsAssigned {
                    partitions: &named(&partitions),
                    assigned_now: self.offsets.assigned().len(),
                }
                .emit(&self.metrics);
            }
            Rebalance::Error(e) => RebalanceFailed { error: &e.to_string() }.emit(&self.metrics),
            Rebalance::Revoke(_) => {}
        }
    }
}
