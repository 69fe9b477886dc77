//! Committing finished offsets, each with its partition's read lease as metadata
//! ([`crate::source::redelivery`]), in one of two delivery modes:
//!
//! - **at least once**: outcome records were published (and acknowledged) before their offsets
//!   were acknowledged to the tracker; the consumer commits offsets on a timer. A worker killed
//!   between the two announces a task twice.
//! - **exactly once**: outcome records wait in the [`Outbox`] for the next transaction, which
//!   carries them with the offsets that cover them, with the consumer's group metadata, so a
//!   `read_committed` reader sees each outcome once and a fenced (zombie) worker commits
//!   nothing. A partition commits in order while tasks finish out of order: a record finished
//!   ahead of its partition's position is covered by the position's metadata instead
//!   ([`crate::source::done_ahead`]), so its outcome is announced in the first transaction after
//!   it finished, not after every earlier task of its partition. The cost is a transaction's
//!   round trips.
//!
//! One commit runs at a time (the timer's, the revoke callback's and the final one share a lock),
//! and each computes what to commit under that lock: offsets never move backwards.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::{Offset, TopicPartitionList};
use sluice_service::kafka_failure::{self, Failure};
use sluice_service::transaction_producer::TransactionProducer;
use tokio_util::sync::CancellationToken;

use crate::events::{Emit, OffsetsCommitted};
use crate::metrics::Metrics;
use crate::source::TaskConsumer;
use crate::source::offsets::{Commit, Offsets, TopicPartition};
use crate::source::record::Origin;
use crate::source::redelivery::lease_metadata;

/// How long one transactional step may block.
const TXN_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a commit waits for its records' delivery: past librdkafka's own message timeout
/// (the transaction's, 15 s), which fails a record not delivered by then.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The offsets of `commits`, each with its lease and its started records as metadata.
pub(crate) fn list_of(commits: &[Commit]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for c in commits {
        let mut e = tpl.add_partition(&c.tp.topic, c.tp.partition);
        if e.set_offset(Offset::Offset(c.offset)).is_ok() {
            e.set_metadata(format!(
                "{}{}{}",
                lease_metadata(c.lease_end),
                crate::source::crash_guard::starts_metadata(&c.started),
                crate::source::done_ahead::done_metadata(&c.done)
            ));
        }
    }
    tpl
}

/// One outcome record waiting for its transaction.
#[derive(Clone)]
pub(crate) struct OutRecord {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: OwnedHeaders,
}

/// Outcome records waiting for their offsets to become committable, by origin.
#[derive(Default)]
pub(crate) struct Outbox {
    held: Mutex<BTreeMap<(TopicPartition, i64), (u64, Vec<OutRecord>)>>,
}

type Taken = Vec<((TopicPartition, i64), (u64, Vec<OutRecord>))>;

impl Outbox {
    pub(crate) fn push(&self, origin: &Origin, record: OutRecord) {
        let mut held = self.held.lock().expect("outbox");
        let entry = held
            .entry((TopicPartition::of(origin), origin.offset))
            .or_insert_with(|| (origin.generation, Vec::new()));
        if entry.0 != origin.generation {
            *entry = (origin.generation, Vec::new()); // left over from an earlier assignment
        }
        entry.1.push(record);
    }

    /// Takes the records each commit covers (below its offset, or finished ahead of it) that
    /// belong to its assignment; drops those of earlier assignments.
    fn take(&self, commits: &[Commit]) -> Taken {
        let mut held = self.held.lock().expect("outbox");
        let mut out = Vec::new();
        for c in commits {
            let keys: Vec<_> = held
                .range((c.tp.clone(), i64::MIN)..=(c.tp.clone(), i64::MAX))
                .map(|(k, _)| k.clone())
                .filter(|(_, offset)| *offset < c.offset || c.done.contains(offset))
                .collect();
            for k in keys {
                let (generation, records) = held.remove(&k).expect("listed");
                if generation == c.generation {
                    out.push((k, (generation, records)));
                }
            }
        }
        out
    }

    /// Puts back what a failed transaction took.
    fn restore(&self, taken: Taken) {
        self.held.lock().expect("outbox").extend(taken);
    }

    /// Drops the records of partitions no longer assigned: their tasks are read again.
    fn forget(&self, partitions: &[TopicPartition]) {
        self.held.lock().expect("outbox").retain(|(tp, _), _| !partitions.contains(tp));
    }

    /// Records waiting.
    pub(crate) fn len(&self) -> usize {
        self.held.lock().expect("outbox").values().map(|(_, r)| r.len()).sum()
    }
}

/// The transactional side of exactly-once delivery.
///
/// Two producers, each with its own transactional id, take turns. A transaction's commit
/// returns once the coordinator has logged it, but the coordinator then still writes its
/// markers, and until they are written it answers the same producer's next transaction
/// `CONCURRENT_TRANSACTIONS` (Kafka's transaction protocol before KIP-890, all librdkafka 2.12
/// speaks); librdkafka retries after `retry.backoff.ms`. Transactions run back to back while
/// tasks finish, so with one producer nearly every one waited out the one before's markers:
/// 10–30 ms of a 20–60 ms round, measured on the mixed row of `sluice-bench delivery`. The other
/// producer's coordinator state is settled by its turn. Transactions still run one at a time
/// (the committer's lock), each begun after the one before was committed, so offsets and
/// records keep their order: the group coordinator applies transactional offsets by their
/// position in its log, and `read_committed` readers never read past an open transaction.
pub(crate) struct Transactional {
    producers: [TransactionProducer; 2],
    /// Which of `producers` runs the next transaction.
    turn: std::sync::atomic::AtomicUsize,
    outbox: Arc<Outbox>,
    /// Fired on an error a producer cannot recover from (fenced by a newer instance of its
    /// transactional id, or a fatal producer error): the worker exits.
    fatal: CancellationToken,
}

/// Commits offsets in the worker's delivery mode.
pub(crate) struct Committer {
    transactional: Option<Transactional>,
    lock: Mutex<()>,
}

impl Committer {
    pub(crate) fn at_least_once() -> Committer {
        Committer {
            transactional: None,
            lock: Mutex::new(()),
        }
    }

    pub(crate) fn exactly_once(t: Transactional) -> Committer {
        Committer {
            transactional: Some(t),
            lock: Mutex::new(()),
        }
    }

    pub(crate) fn is_transactional(&self) -> bool {
        self.transactional.is_some()
    }

    /// Commits what can be committed now. Returns whether there was anything to commit (a
    /// transaction, or a commit, was tried). Blocks.
    pub(crate) fn commit_now(&self, consumer: &TaskConsumer, offsets: &Offsets, metrics: &Metrics) -> bool {
        let _one = self.lock.lock().expect("commit lock");
        let commits = offsets.commit_candidates();
        let outbox_waiting = self.transactional.as_ref().is_some_and(|t| t.outbox.len() > 0);
        if commits.is_empty() && !outbox_waiting {
            return false;
        }
        let began = std::time::Instant::now();
        let result = self.commit(consumer, &commits);
        if result.is_ok() {
            offsets.committed(&commits);
        }
        OffsetsCommitted {
            partitions: commits.len(),
            took: began.elapsed(),
            error: result.as_ref().err().map(|e| e.to_string()).as_deref(),
        }
        .emit(metrics);
        true
    }

    /// Exactly-once: records model calls' starts with a plain offset commit (no offset moves:
    /// each partition at what it last committed), between transactions — a transaction in
    /// flight could otherwise be overtaken and its offsets lost. At least once the regular
    /// commit does it. Blocks.
    pub(crate) fn commit_starts(&self, consumer: &TaskConsumer, offsets: &Offsets) {
        if self.transactional.is_none() {
            return;
        }
        let _one = self.lock.lock().expect("commit lock");
        let commits = offsets.start_candidates();
        if commits.is_empty() {
            return;
        }
        match consumer.commit(&list_of(&commits), rdkafka::consumer::CommitMode::Sync) {
            Ok(()) => offsets.committed(&commits),
            Err(e) => tracing::warn!(error = %e, "recording model calls' starts failed; the next transaction carries them"),
        }
    }

    /// The final commit of revoked partitions; their held records are dropped afterwards.
    /// Blocks.
    pub(crate) fn commit_revoked(
        &self,
        consumer: &TaskConsumer,
        offsets: &Offsets,
        partitions: &[TopicPartition],
    ) -> (Vec<Commit>, Result<(), KafkaError>) {
        let _one = self.lock.lock().expect("commit lock");
        let commits = offsets.revoke(partitions);
        let result = if commits.is_empty() {
            Ok(())
        } else {
            self.commit(consumer, &commits)
        };
        if let Some(t) = &self.transactional {
            t.outbox.forget(partitions);
        }
        (commits, result)
    }

    fn commit(&self, consumer: &TaskConsumer, commits: &[Commit]) -> Result<(), KafkaError> {
        match &self.transactional {
            None => consumer.commit(&list_of(commits), rdkafka::consumer::CommitMode::Sync),
            Some(t) => t.commit(consumer, commits),
        }
    }
}

impl Transactional {
    pub(crate) fn new(producers: [TransactionProducer; 2], outbox: Arc<Outbox>, fatal: CancellationToken) -> Transactional {
        Transactional {
            producers,
            turn: std::sync::atomic::AtomicUsize::new(0),
            outbox,
            fatal,
        }
    }

    /// One transaction: the held records below `commits`, then the offsets, then commit. On
    /// failure the transaction is aborted and the records held again for the next one; only an
    /// error the producer cannot recover from ends the worker.
    fn commit(&self, consumer: &TaskConsumer, commits: &[Commit]) -> Result<(), KafkaError> {
        let taken = self.outbox.take(commits);
        if commits.is_empty() && taken.is_empty() {
            return Ok(());
        }
        // Called under the committer's lock: one transaction at a time.
        let producer = &self.producers[self.turn.fetch_xor(1, std::sync::atomic::Ordering::Relaxed) & 1];
        let result = Self::transaction(producer, consumer, commits, &taken);
        if let Err(e) = &result {
            let failure = kafka_failure::classify(e);
            if failure.ends_client() {
                tracing::error!(error = %e, %failure, "the transactional producer failed for good (fenced: a newer instance has its transactional id; or fatal); the worker exits");
                self.fatal.cancel();
            } else if let Err(abort) = retrying(|| producer.abort_transaction(TXN_TIMEOUT)) {
                tracing::error!(error = %abort, "aborting a failed transaction failed; the worker exits");
                self.fatal.cancel();
            }
            self.outbox.restore(taken);
        }
        result
    }

    fn transaction(producer: &TransactionProducer, consumer: &TaskConsumer, commits: &[Commit], taken: &Taken) -> Result<(), KafkaError> {
        producer.begin_transaction()?;
        for (_, (_, records)) in taken {
            for r in records {
                producer.send(&r.topic, r.key.as_deref(), &r.payload, &r.headers)?;
            }
        }
        if !commits.is_empty() {
            // Only a consumer with no group has none.
            let group = consumer
                .group_metadata()
                .ok_or(KafkaError::MessageProduction(RDKafkaErrorCode::InvalidArgument))?;
            let offsets = list_of(commits);
            retrying(|| producer.send_offsets_to_transaction(&offsets, &group, TXN_TIMEOUT))?;
        }
        // Every record delivered before the commit, its report served: rdkafka's
        // commit_transaction flushes first, and its flush, finding anything still counted,
        // waits a whole 100 ms (its poll returns at the deadline, not at an event).
        producer.delivered(DELIVERY_TIMEOUT)?;
        retrying(|| producer.commit_transaction(TXN_TIMEOUT))
    }
}

/// Runs a transactional step again while it fails with an error librdkafka calls retriable (a
/// timeout while the broker is away), for up to two minutes: a broker restart must not cost the
/// worker its process.
fn retrying(mut step: impl FnMut() -> Result<(), KafkaError>) -> Result<(), KafkaError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        match step() {
            Err(e) if kafka_failure::classify(&e) == Failure::Retriable && std::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "transactional step failed; retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// Commits until `stop` fires: on a timer, at once when the tracker asks (a lease extension, a
/// model call's starts: work waits on those) and, in exactly-once mode, whenever a task was
/// acknowledged — but then no sooner than `transaction_interval` after the last transaction
/// began, unless an interactive task finished: while tasks finish, each transaction takes what
/// finished since the one before. A commit can block for as long as the broker is unreachable,
/// so it runs on the blocking pool, one at a time.
///
/// Why the interval: back to back, a transaction took 5–20 ms on the local broker and carried
/// the 2–5 tasks of the ~1 ms model that finished meanwhile (60–155 a second); each costs the
/// worker ~1.5 ms of CPU in librdkafka's round trips and thread switches, and the broker its
/// markers: ~0.25 ms of the worker's CPU per task (docs/benchmarks.md, "Transactions at most
/// every 30 ms"). A task waits at most the interval for its announcement, and only under load:
/// the first to finish after a quiet spell goes at once.
pub(crate) async fn commit_loop(
    committer: Arc<Committer>,
    consumer: Arc<TaskConsumer>,
    offsets: Arc<Offsets>,
    interval: Duration,
    transaction_interval: Duration,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let eager = committer.is_transactional();
    // A commit something waits on (a read lease, a model call's starts) or an interactive task's
    // announcement arrived during the interval: it goes at once.
    let mut wanted = false;
    loop {
        if !std::mem::take(&mut wanted) {
            tokio::select! {
                _ = tick.tick() => {}
                _ = offsets.commit_wanted.notified() => {}
                _ = offsets.acked.notified(), if eager => {}
                _ = stop.cancelled() => return,
            }
        }
        let began = tokio::time::Instant::now();
        let (c, k, o, m) = (committer.clone(), consumer.clone(), offsets.clone(), metrics.clone());
        let mut running = tokio::task::spawn_blocking(move || {
            c.commit_starts(&k, &o); // first: model calls wait on it
            c.commit_now(&k, &o, &m)
        });
        let tried = loop {
            tokio::select! {
                done = &mut running => break done.unwrap_or(false),
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(10)) => {
                    tracing::warn!("an offset commit has not returned for 10 s (broker unreachable?)");
                }
            }
        };
        // Acknowledgements in the meantime are kept (`notify_one` stores one), so what finishes
        // now goes with the next transaction, at the end of the interval; work waiting on a
        // commit, and an interactive task's announcement, do not wait for it.
        if eager && tried {
            tokio::select! {
                _ = tokio::time::sleep_until(began + transaction_interval) => {}
                _ = offsets.commit_wanted.notified() => wanted = true,
                _ = offsets.acked_interactive.notified() => wanted = true,
                _ = stop.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> TopicPartition {
        TopicPartition {
            topic: "t".into(),
            partition: p,
        }
    }

    fn origin(p: i32, offset: i64, generation: u64) -> Origin {
        Origin {
            topic: "t".into(),
            partition: p,
            offset,
            generation,
        }
    }

    fn record(name: &str) -> OutRecord {
        OutRecord {
            topic: name.into(),
            key: None,
            payload: Vec::new(),
            headers: OwnedHeaders::new(),
        }
    }

    fn commit(p: i32, offset: i64, generation: u64) -> Commit {
        Commit {
            tp: tp(p),
            offset,
            generation,
            lease_end: 0,
            started: BTreeMap::new(),
            starts_version: 0,
            done: Default::default(),
        }
    }

    fn topics(taken: &Taken) -> Vec<String> {
        taken.iter().flat_map(|(_, (_, rs))| rs.iter().map(|r| r.topic.clone())).collect()
    }

    #[test]
    fn a_transaction_takes_exactly_the_records_its_offsets_cover() {
        let outbox = Outbox::default();
        outbox.push(&origin(0, 3, 1), record("dlq-3"));
        outbox.push(&origin(0, 3, 1), record("failed-3"));
        outbox.push(&origin(0, 5, 1), record("done-5")); // finished before 4: waits for it
        outbox.push(&origin(1, 0, 1), record("done-p1"));
        let taken = outbox.take(&[commit(0, 4, 1)]);
        assert_eq!(topics(&taken), ["dlq-3", "failed-3"]);
        assert_eq!(outbox.len(), 2);
        outbox.restore(taken);
        assert_eq!(outbox.len(), 4, "an aborted transaction's records are held again");
        let taken = outbox.take(&[commit(0, 6, 1), commit(1, 1, 1)]);
        assert_eq!(topics(&taken), ["dlq-3", "failed-3", "done-5", "done-p1"]);
        assert_eq!(outbox.len(), 0);
    }

    #[test]
    fn a_record_finished_ahead_of_the_position_goes_with_the_commit_that_lists_it() {
        let outbox = Outbox::default();
        outbox.push(&origin(0, 5, 1), record("done-5"));
        outbox.push(&origin(0, 7, 1), record("done-7"));
        outbox.push(&origin(0, 9, 1), record("done-9")); // past the metadata's bound, say
        let ahead = Commit {
            done: [5, 7].into(),
            ..commit(0, 4, 1)
        };
        assert_eq!(topics(&outbox.take(&[ahead])), ["done-5", "done-7"]);
        assert_eq!(outbox.len(), 1, "what the commit does not list waits for the position");
        assert_eq!(topics(&outbox.take(&[commit(0, 10, 1)])), ["done-9"]);
    }

    #[test]
    fn records_of_an_earlier_assignment_are_never_committed() {
        let outbox = Outbox::default();
        outbox.push(&origin(0, 1, 1), record("old"));
        assert!(outbox.take(&[commit(0, 2, 2)]).is_empty(), "the partition was assigned again since");
        assert_eq!(outbox.len(), 0, "and the stale record is dropped");
        outbox.push(&origin(0, 1, 1), record("old"));
        outbox.push(&origin(0, 1, 2), record("new"));
        assert_eq!(topics(&outbox.take(&[commit(0, 2, 2)])), ["new"]);
    }

    #[test]
    fn revoked_partitions_are_forgotten() {
        let outbox = Outbox::default();
        outbox.push(&origin(0, 1, 1), record("a"));
        outbox.push(&origin(1, 1, 1), record("b"));
        outbox.forget(&[tp(0)]);
        assert_eq!(outbox.len(), 1);
    }
}
