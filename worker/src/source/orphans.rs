//! Orphaned partitions: partitions of the task topics that no member of the group owns while the
//! group says it is stable, so their tasks never run.
//!
//! How it happens (classic protocol, cooperative-sticky, static members): an incremental
//! rebalance has two phases. In the first, a member gives up the partitions another is to get;
//! only when it rejoins does the second phase hand them over. A static member restarted between
//! the two (killed while it drained what it gave up) rejoins a stable group under its old
//! identity and gets its cached assignment back without a rebalance: the second phase never
//! comes. No member can see this from its own assignment; the group's description shows it.
//!
//! The repair: every worker compares the group's assignments with the topics' partitions every
//! few seconds. Partitions unowned while the group stays stable for longer than a revocation
//! may take (the drain timeout, plus a margin) are handed out by a rebalance: a short-lived
//! member without a static identity joins the group, which makes the leader assign every
//! partition again, and leaves at once, which rebalances once more without it. It never fetches
//! for work or commits. Under KIP-848 the broker assigns, and this does not run.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use super::TaskConsumer;
use crate::events::{Emit, OrphansRepaired};
use crate::metrics::Metrics;

/// How often the group is described.
const EVERY: Duration = Duration::from_secs(3);
/// Margin over the drain timeout before unowned partitions count as orphaned.
const MARGIN: Duration = Duration::from_secs(5);
/// The longest the repairing member waits to be assigned before it leaves anyway.
const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Error, PartialEq)]
pub(crate) enum AssignmentError {
    #[error("the member assignment ends early, at byte {0}")]
    Truncated(usize),
    #[error("a topic name in the member assignment is not UTF-8")]
    TopicName,
}

/// The partitions of `topic` in a member's assignment as the classic consumer protocol encodes
/// it (`ConsumerProtocolAssignment` v0–v3: version, then an array of topic and partition
/// array; the user data after it is not read). Empty bytes: nothing assigned.
pub(crate) fn assigned_partitions(bytes: &[u8], topic: &str) -> Result<Vec<i32>, AssignmentError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], AssignmentError> {
        let slice = bytes.get(at..at + n).ok_or(AssignmentError::Truncated(at))?;
        at += n;
        Ok(slice)
    };
    let _version = take(2)?;
    let topics = i32::from_be_bytes(take(4)?.try_into().expect("4 bytes"));
    let mut found = Vec::new();
    for _ in 0..topics.max(0) {
        let length = i16::from_be_bytes(take(2)?.try_into().expect("2 bytes"));
        let name = std::str::from_utf8(take(length.max(0) as usize)?).map_err(|_| AssignmentError::TopicName)?;
        let ours = name == topic;
        let count = i32::from_be_bytes(take(4)?.try_into().expect("4 bytes"));
        for _ in 0..count.max(0) {
            let partition = i32::from_be_bytes(take(4)?.try_into().expect("4 bytes"));
            if ours {
                found.push(partition);
            }
        }
    }
    Ok(found)
}

/// A partition of one of the task topics: `(topic, partition)`.
pub(crate) type Part = (String, i32);

/// Which partitions have been unowned, while the group stayed stable, for longer than `grace`.
#[derive(Debug)]
pub(crate) struct Watch {
    grace: Duration,
    since: BTreeMap<Part, Instant>,
}

impl Watch {
    pub(crate) fn new(grace: Duration) -> Watch {
        Watch {
            grace,
            since: BTreeMap::new(),
        }
    }

    /// One look at the group: `None` when it is not stable (a rebalance is under way, which
    /// starts every count again), else the partitions no member owns. Returns the orphaned
    /// ones, then starts counting afresh.
    pub(crate) fn observe(&mut self, now: Instant, unowned: Option<&BTreeSet<Part>>) -> Option<(BTreeSet<Part>, Duration)> {
        let Some(unowned) = unowned else {
            self.since.clear();
            return None;
        };
        self.since.retain(|p, _| unowned.contains(p));
        for p in unowned {
            self.since.entry(p.clone()).or_insert(now);
        }
        let oldest = self.since.values().min().copied()?;
        let orphaned: BTreeSet<Part> = self
            .since
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= self.grace)
            .map(|(p, _)| p.clone())
            .collect();
        if orphaned.is_empty() {
            return None;
        }
        self.since.clear();
        Some((orphaned, now.duration_since(oldest)))
    }
}

/// The partitions of `topics` that no member of `group` owns, or `None` while the group is not
/// stable (or is not a classic consumer group).
fn unowned(consumer: &TaskConsumer, group: &str, topics: &[String], timeout: Duration) -> Result<Option<BTreeSet<Part>>, String> {
    let groups = consumer.fetch_group_list(Some(group), timeout).map_err(|e| e.to_string())?;
    let Some(info) = groups.groups().iter().find(|g| g.name() == group) else {
        return Ok(None);
    };
    if info.state() != "Stable" || info.protocol_type() != "consumer" {
        return Ok(None);
    }
    let mut unowned = BTreeSet::new();
    for topic in topics {
        let mut owned = BTreeSet::new();
        for member in info.members() {
            let bytes = member.assignment().unwrap_or_default();
            owned.extend(assigned_partitions(bytes, topic).map_err(|e| format!("member {}: {e}", member.id()))?);
        }
        let metadata = consumer.fetch_metadata(Some(topic), timeout).map_err(|e| e.to_string())?;
        let Some(described) = metadata.topics().iter().find(|t| t.name() == topic) else {
            // Gone from the cluster (deleted while the worker runs): the others are still watched.
            tracing::warn!(topic, "orphan watch: a task topic is not in the cluster's metadata");
            continue;
        };
        unowned.extend(
            described
                .partitions()
                .iter()
                .map(|p| p.id())
                .filter(|p| !owned.contains(p))
                .map(|p| (topic.clone(), p)),
        );
    }
    Ok(Some(unowned))
}

/// Marks when the repairing member has been through a rebalance.
struct Joined(Arc<std::sync::atomic::AtomicBool>);

impl ClientContext for Joined {}

impl ConsumerContext for Joined {
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if matches!(rebalance, Rebalance::Assign(_)) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// Joins the group as a member without a static identity, until assigned, and leaves: two
/// rebalances, the first of which assigns every partition of the topics.
fn rebalance(config: &ClientConfig, topics: &[String]) -> Result<(), KafkaError> {
    let joined = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let member: BaseConsumer<Joined> = config.create_with_context(Joined(joined.clone()))?;
    member.subscribe(&topics.iter().map(String::as_str).collect::<Vec<_>>())?;
    let deadline = Instant::now() + JOIN_TIMEOUT;
    while !joined.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
        // Records it may be handed are dropped: it never commits, so the real owner reads them.
        let _ = member.poll(Duration::from_millis(100));
    }
    member.unsubscribe();
    Ok(()) // dropping the consumer leaves the group
}

/// Watches the group until `close`, repairing orphaned partitions. `member` is the repairing
/// member's configuration (the group, no static identity). Runs on its own thread.
pub(crate) fn watch(
    consumer: Arc<TaskConsumer>,
    member: ClientConfig,
    group: String,
    topics: Vec<String>,
    drain_timeout: Duration,
    close: CancellationToken,
    metrics: Metrics,
) {
    let mut watch = Watch::new(drain_timeout + MARGIN);
    while !close.is_cancelled() {
        std::thread::sleep(EVERY);
        let seen = match unowned(&consumer, &group, &topics, Duration::from_secs(5)) {
            Ok(seen) => seen,
            Err(error) => {
                tracing::debug!(error, "describing the group failed; trying again");
                continue;
            }
        };
        if let Some((partitions, unowned_for)) = watch.observe(Instant::now(), seen.as_ref()) {
            let error = rebalance(&member, &topics).err().map(|e| e.to_string());
            OrphansRepaired {
                partitions: &partitions.iter().cloned().collect::<Vec<_>>(),
                unowned_for,
                error: error.as_deref(),
            }
            .emit(&metrics);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(version: i16, topics: &[(&str, &[i32])], user_data: &[u8]) -> Vec<u8> {
        let mut b = version.to_be_bytes().to_vec();
        b.extend((topics.len() as i32).to_be_bytes());
        for (name, partitions) in topics {
            b.extend((name.len() as i16).to_be_bytes());
            b.extend(name.as_bytes());
            b.extend((partitions.len() as i32).to_be_bytes());
            for p in *partitions {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((user_data.len() as i32).to_be_bytes());
        b.extend(user_data);
        b
    }

    #[test]
    fn reads_the_consumer_protocol_assignment() {
        let bytes = encode(3, &[("other", &[0, 1]), ("tasks", &[4, 7, 2])], b"sticky");
        assert_eq!(assigned_partitions(&bytes, "tasks"), Ok(vec![4, 7, 2]));
        assert_eq!(assigned_partitions(&bytes, "absent"), Ok(vec![]));
        assert_eq!(assigned_partitions(&[], "tasks"), Ok(vec![]));
        assert_eq!(assigned_partitions(&encode(0, &[], &[]), "tasks"), Ok(vec![]));
        assert!(matches!(
            assigned_partitions(&bytes[..bytes.len() - 14], "tasks"),
            Err(AssignmentError::Truncated(_))
        ));
    }

    #[test]
    fn only_partitions_unowned_for_the_whole_grace_while_stable_are_orphaned() {
        let grace = Duration::from_secs(10);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let set = |ps: &[i32]| ps.iter().map(|p| ("t".to_owned(), *p)).collect::<BTreeSet<Part>>();
        let mut w = Watch::new(grace);
        assert_eq!(w.observe(at(0), Some(&set(&[4, 5]))), None);
        assert_eq!(w.observe(at(6), Some(&set(&[4, 5, 6]))), None);
        // 5 was owned again for a moment: its count starts over.
        assert_eq!(w.observe(at(8), Some(&set(&[4, 6]))), None);
        assert_eq!(w.observe(at(9), Some(&set(&[4, 5, 6]))), None);
        let (orphaned, unowned_for) = w.observe(at(10), Some(&set(&[4, 5, 6]))).unwrap();
        assert_eq!(orphaned, set(&[4]));
        assert_eq!(unowned_for, grace);
        // Counted afresh after a repair.
        assert_eq!(w.observe(at(11), Some(&set(&[4, 5, 6]))), None);
        // A rebalance under way resets everything.
        let mut w = Watch::new(grace);
        w.observe(at(0), Some(&set(&[1])));
        assert_eq!(w.observe(at(5), None), None);
        assert_eq!(w.observe(at(12), Some(&set(&[1]))), None);
        assert_eq!(w.observe(at(22), Some(&set(&[1]))).map(|(o, _)| o), Some(set(&[1])));
        assert_eq!(w.observe(at(40), Some(&set(&[]))), None);
    }
}
