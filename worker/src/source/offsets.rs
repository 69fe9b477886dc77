//! Ordered offset tracking: per partition, offset N is committed only once every record below N
//! has been finished (its completion or DLQ record acknowledged by the broker).
//!
//! Tasks finish out of order — inside a batch, across batches, and when a poison record goes to
//! the DLQ at once — so the committable offset of a partition is the lowest offset still
//! pending, or one past the last record read when none is: each partition's window is a
//! [`OrderedAcks`], the type the producer's webhook notifier commits with too.
//!
//! Each commit also carries the partition's read lease as its metadata (how far records may have
//! been started: see [`crate::source::redelivery`]); the tracker keeps the lease found at assignment,
//! the one wanted and the one the broker acknowledged — and the records this consumer has
//! started and not finished, with how often each was started (see [`crate::source::crash_guard`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sluice_service::ordered_acks::OrderedAcks;

use crate::source::record::Origin;

/// A topic partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicPartition {
    pub topic: Arc<str>,
    pub partition: i32,
}

impl TopicPartition {
    /// The partition a record was read from.
    pub fn of(origin: &Origin) -> TopicPartition {
        TopicPartition {
            topic: origin.topic.clone(),
            partition: origin.partition,
        }
    }
}

/// A partition's read lease: offsets below `confirmed` may be started by this consumer; records
/// below `previous` may have been started by an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The lease end committed by the partition's previous owner (0 when none).
    pub previous: i64,
    /// The lease end the next commit writes (never below `previous`).
    pub wanted: i64,
    /// The lease end the broker acknowledged.
    pub confirmed: i64,
}

/// What the tracker knows of a record's partition lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// The record's assignment is over.
    Gone,
    /// Not read yet (or the last read or write failed less than a second ago: `may_try` false).
    Unknown {
        may_try: bool,
    },
    Known {
        lease: Lease,
        may_try: bool,
    },
}

/// After a failed lease read or write, how long records are checked rather than waiting on the
/// broker again.
const LEASE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// One partition's commit: the next offset to read and, as its metadata, the read lease and
/// the records started and not finished.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Commit {
    pub tp: TopicPartition,
    pub offset: i64,
    pub generation: u64,
    pub lease_end: i64,
    /// Records started and not finished, and how many times each was started.
    pub started: BTreeMap<i64, u32>,
    /// The version of `started` this commit writes.
    pub starts_version: u64,
    /// Records at or beyond `offset` that are finished, their outcomes announced with this
    /// commit ([`crate::source::done_ahead`]); bounded.
    pub done: BTreeSet<i64>,
}

/// Where an assigned partition is in its life (vector's `Consuming`/`Draining`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its records start as they come.
    Consuming,
    /// Being revoked: work not yet started on it is released rather than run, and commits stop
    /// below the lowest offset released unfinished.
    Draining { released: Option<i64> },
}

#[derive(Debug)]
struct Partition {
    generation: u64,
    /// Offsets read and not yet finished, with when they were read.
    pending: OrderedAcks<Instant>,
    /// The first offset read under this assignment.
    first: Option<i64>,
    /// The last offset committed (the next record to read after a restart).
    committed: Option<i64>,
    phase: Phase,
    /// `None` until the previous owner's lease is read: until then nothing is committed, since
    /// a commit would overwrite that lease.
    lease: Option<Lease>,
    /// When a lease read or write last failed.
    lease_failed_at: Option<Instant>,
    /// Records started under this assignment and not finished, with how many times each has
    /// been started (the previous owners' starts included).
    started: BTreeMap<i64, u32>,
    /// What the previous owner left started and unfinished (read with its lease).
    previous_starts: Option<BTreeMap<i64, u32>>,
    /// Bumped when the started set changes; the version the broker acknowledged.
    starts_version: u64,
    starts_confirmed: u64,
    /// The version a model call waits for (a start): a start is recorded at once, an end rides
    /// along with the next commit.
    starts_awaited: u64,
    /// Records finished ahead of the committed position whose finishing a commit carried (or
    /// the previous owner's commit did: those are skipped when read).
    done_written: BTreeSet<i64>,
    /// Records finished ahead of the position that no commit has carried yet.
    done_new: BTreeSet<i64>,
}

impl Partition {
    fn committable(&self) -> Option<i64> {
        let c = self.pending.committable()?;
        match self.phase {
            Phase::Draining { released: Some(r) } => Some(r.min(c)),
            _ => Some(c),
        }
    }

    /// The commit this partition needs now, if any: a new offset, a longer lease, new starts or
    /// records newly finished ahead of the position (within the metadata's bound).
    fn commit(&self, tp: &TopicPartition) -> Option<Commit> {
        let lease = self.lease?;
        let offset = self.committable()?;
        let due = self.committed != Some(offset) || lease.wanted > lease.confirmed || self.starts_changed();
        if !due && self.done_new.range(offset..).next().is_none() {
            return None; // the common case, asked on every acknowledgement: nothing to build
        }
        let commit = self.commit_at(tp, offset, lease, true);
        // Records finished ahead all past the metadata's bound wait for the position.
        (due || commit.done.iter().any(|o| self.done_new.contains(o))).then_some(commit)
    }

    /// A commit of `offset` carrying the wanted lease, the starts as they are now and the records
    /// finished ahead of it: all of them (`with_new`), or only those a commit already carried.
    fn commit_at(&self, tp: &TopicPartition, offset: i64, lease: Lease, with_new: bool) -> Commit {
        let done = if with_new {
            let all: BTreeSet<i64> = self.done_written.union(&self.done_new).copied().collect();
            crate::source::done_ahead::bounded(all.range(offset..))
        } else {
            crate::source::done_ahead::bounded(self.done_written.range(offset..))
        };
        Commit {
            tp: tp.clone(),
            offset,
            generation: self.generation,
            lease_end: lease.wanted,
            started: self.started.range(offset..).map(|(o, n)| (*o, *n)).collect(),
            starts_version: self.starts_version,
            done,
        }
    }

    fn starts_changed(&self) -> bool {
        self.starts_version > self.starts_confirmed
    }

    /// Takes back this owner's start of `offset` (its count back to the previous owners'):
    /// its model call ended, or the record is handed off unfinished.
    fn unstart(&mut self, offset: i64) {
        let before = self.previous_starts.as_ref().and_then(|s| s.get(&offset)).copied().unwrap_or(0);
        if self.started.get(&offset).is_some_and(|n| *n > before) {
            if before == 0 {
                self.started.remove(&offset);
            } else {
                self.started.insert(offset, before);
            }
            self.starts_version += 1;
        }
    }

    /// Hands off what this owner started and has not finished: a graceful end (a drain or a
    /// shutdown grace over), not a crash, so the next owner does not count it as one.
    fn hand_off(&mut self) {
        let mine: Vec<i64> = self.started.keys().copied().collect();
        for offset in mine {
            self.unstart(offset);
        }
    }

    fn may_try(&self) -> bool {
        self.lease_failed_at.is_none_or(|t| t.elapsed() >= LEASE_RETRY_AFTER)
    }
}

#[derive(Debug, Default)]
struct State {
    partitions: HashMap<TopicPartition, Partition>,
    generation: u64,
    in_flight: usize,
    /// The shutdown grace is over and what was still running was given up
    /// ([`Offsets::hand_off_all`]): a revoke no longer waits for it.
    given_up: bool,
}

/// The tracker. Shared by the source thread (which tracks records as it reads them and drains
/// partitions on revoke), the stages (which acknowledge) and the committer.
#[derive(Debug, Default)]
pub struct Offsets {
    state: Mutex<State>,
    finished: Condvar,
    /// Woken when a commit is wanted before the next tick (a lease extension).
    pub(crate) commit_wanted: tokio::sync::Notify,
    /// Woken on every acknowledgement (the transactional committer commits as they come).
    pub(crate) acked: tokio::sync::Notify,
    /// Woken when an interactive task is acknowledged: in exactly-once mode the transaction
    /// that announces it begins at once, not at the end of the transaction interval.
    pub(crate) acked_interactive: tokio::sync::Notify,
    /// Woken after every successful commit (lease extensions wait on it).
    committed_now: tokio::sync::Notify,
}

impl Offsets {
    pub fn new() -> Offsets {
        Offsets::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("offsets lock")
    }

    /// Starts tracking newly assigned partitions, under a new generation.
    pub fn assign(&self, partitions: &[TopicPartition]) {
        let mut state = self.lock();
        state.generation += 1;
        let generation = state.generation;
        for tp in partitions {
            if let Some(old) = state.partitions.remove(tp) {
                state.in_flight -= old.pending.len();
            }
            state.partitions.insert(
                tp.clone(),
                Partition {
                    generation,
                    pending: OrderedAcks::new(),
                    first: None,
                    committed: None,
                    phase: Phase::Consuming,
                    lease: None,
                    lease_failed_at: None,
                    started: BTreeMap::new(),
                    previous_starts: None,
                    starts_version: 0,
                    starts_confirmed: 0,
                    starts_awaited: 0,
                    done_written: BTreeSet::new(),
                    done_new: BTreeSet::new(),
                },
            );
        }
    }

    /// Records that `offset` was read. Returns its origin, or `None` when the partition is not
    /// assigned (a record that raced a revoke; it will be read again by the new owner).
    pub fn track(&self, tp: &TopicPartition, offset: i64) -> Option<Origin> {
        let mut state = self.lock();
        let partition = state.partitions.get_mut(tp)?;
        if !partition.pending.read(offset, Instant::now()) {
            return None; // read twice under one assignment (a seek); the first one is in flight
        }
        partition.first = Some(partition.first.map_or(offset, |f| f.min(offset)));
        let generation = partition.generation;
        state.in_flight += 1;
        Some(Origin {
            topic: tp.topic.clone(),
            partition: tp.partition,
            offset,
            generation,
        })
    }

    /// Marks a record finished. Returns false when the acknowledgement is stale: the partition
    /// was revoked (or revoked and assigned again) since the record was read.
    pub fn ack(&self, origin: &Origin) -> bool {
        let mut state = self.lock();
        let tp = TopicPartition::of(origin);
        let Some(partition) = state.partitions.get_mut(&tp) else {
            return false;
        };
        if partition.generation != origin.generation || partition.pending.finish(origin.offset).is_none() {
            return false;
        }
        partition.started.remove(&origin.offset);
        if !partition.done_written.contains(&origin.offset) {
            partition.done_new.insert(origin.offset);
        }
        state.in_flight -= 1;
        drop(state);
        self.finished.notify_all();
        self.acked.notify_one();
        true
    }

    /// [`Offsets::ack`] for a task of lane `lane`: an interactive task's announcement does not
    /// wait out the transaction interval (`SLUICE_TRANSACTION_INTERVAL_MS`).
    pub fn ack_in_lane(&self, origin: &Origin, lane: sluice_schemas::Priority) -> bool {
        let acked = self.ack(origin);
        if acked && lane == sluice_schemas::Priority::Interactive {
            self.acked_interactive.notify_one();
        }
        acked
    }

    /// Whether an earlier owner (or this one, under this assignment) announced `origin`'s
    /// outcome ahead of the committed position: it is acknowledged without running again.
    pub(crate) fn announced_ahead(&self, origin: &Origin) -> bool {
        let state = self.lock();
        state
            .partitions
            .get(&TopicPartition::of(origin))
            .is_some_and(|p| p.generation == origin.generation && p.done_written.contains(&origin.offset))
    }

    /// The lease of `origin`'s partition, under `origin`'s assignment.
    pub fn lease(&self, origin: &Origin) -> LeaseState {
        let state = self.lock();
        match state.partitions.get(&TopicPartition::of(origin)) {
            Some(p) if p.generation == origin.generation => match p.lease {
                Some(lease) => LeaseState::Known {
                    lease,
                    may_try: p.may_try(),
                },
                None => LeaseState::Unknown { may_try: p.may_try() },
            },
            _ => LeaseState::Gone,
        }
    }

    /// Records the lease the previous owner committed (`Ok(end)`, 0 for none), or that reading
    /// it failed. A lease already known is kept.
    pub fn found_lease(&self, origin: &Origin, found: Result<i64, ()>) {
        let mut state = self.lock();
        let Some(p) = state.partitions.get_mut(&TopicPartition::of(origin)) else {
            return;
        };
        if p.generation != origin.generation || p.lease.is_some() {
            return;
        }
        match found {
            Ok(end) => {
                p.lease = Some(Lease {
                    previous: end,
                    wanted: end,
                    confirmed: end,
                });
                p.lease_failed_at = None;
            }
            Err(()) => p.lease_failed_at = Some(Instant::now()),
        }
    }

    /// Whether `origin` belongs to a current assignment (its partition was not revoked since).
    pub(crate) fn is_current(&self, origin: &Origin) -> bool {
        self.lease(origin) != LeaseState::Gone
    }

    /// Records what the previous owner of `origin`'s partition announced ahead of its committed
    /// position (read with its lease). Kept only the first time under an assignment, and carried
    /// in this owner's commits until the position passes each.
    pub(crate) fn found_done(&self, origin: &Origin, done: BTreeSet<i64>) {
        let mut state = self.lock();
        if let Some(p) = state.partitions.get_mut(&TopicPartition::of(origin))
            && p.generation == origin.generation
            && p.lease.is_none()
        {
            p.done_written = done;
        }
    }

    /// Records what the previous owner of `origin`'s partition left started (read with its
    /// lease). Kept only the first time under an assignment.
    pub(crate) fn found_starts(&self, origin: &Origin, starts: BTreeMap<i64, u32>) {
        let mut state = self.lock();
        if let Some(p) = state.partitions.get_mut(&TopicPartition::of(origin))
            && p.generation == origin.generation
            && p.lease.is_none()
            && p.previous_starts.is_none()
        {
            // Carried into this owner's commits until each finishes: a crash of this owner
            // before it reaches them must not reset their counts.
            p.started = starts.clone();
            p.previous_starts = Some(starts);
        }
    }

    /// How many times earlier owners started `origin` without finishing it.
    pub(crate) fn previous_starts(&self, origin: &Origin) -> u32 {
        let state = self.lock();
        state
            .partitions
            .get(&TopicPartition::of(origin))
            .filter(|p| p.generation == origin.generation)
            .and_then(|p| p.previous_starts.as_ref()?.get(&origin.offset).copied())
            .unwrap_or(0)
    }

    /// Notes that `origins` start now (each one's count: the previous owners' starts plus one).
    /// Returns what to wait for with [`Offsets::starts_recorded`]: per partition whose lease is
    /// known and that holds a record an earlier owner may have started (below the lease it
    /// committed), the version that holds these starts; the committer is woken for them. The
    /// other starts ride with the partition's next commit (why that is safe:
    /// [`crate::source::crash_guard`]).
    pub(crate) fn start(&self, origins: &[&Origin]) -> Vec<(Origin, u64)> {
        let mut state = self.lock();
        let mut changed: Vec<TopicPartition> = Vec::new();
        let mut waits: Vec<(Origin, u64)> = Vec::new();
        for origin in origins {
            let tp = TopicPartition::of(origin);
            let Some(p) = state.partitions.get_mut(&tp) else {
                continue;
            };
            let Some(lease) = p.lease else {
                continue; // nothing of it can be committed: the start cannot be recorded
            };
            if p.generation != origin.generation || !p.pending.is_pending(origin.offset) {
                continue;
            }
            let before = p.previous_starts.as_ref().and_then(|s| s.get(&origin.offset)).copied().unwrap_or(0);
            p.started.insert(origin.offset, before + 1);
            if !changed.contains(&tp) {
                p.starts_version += 1;
                changed.push(tp.clone());
            }
            let suspect = origin.offset < lease.previous;
            if suspect && !waits.iter().any(|(o, _)| TopicPartition::of(o) == tp) {
                p.starts_awaited = p.starts_version;
                waits.push(((*origin).clone(), p.starts_version));
            }
        }
        drop(state);
        if !waits.is_empty() {
            self.commit_wanted.notify_one();
        }
        waits
    }

    /// Notes that the model call holding `origin` ended (it returned, with results or an error
    /// a handler saw): from here a kill of the process is no crash of the record's. The next
    /// commit says so (no commit of its own: the task's outcome follows in moments, and with it
    /// a commit).
    pub(crate) fn call_ended(&self, origin: &Origin) {
        let mut state = self.lock();
        if let Some(p) = state
            .partitions
            .get_mut(&TopicPartition::of(origin))
            .filter(|p| p.generation == origin.generation)
        {
            p.unstart(origin.offset);
        }
    }

    /// Hands off every record started and not finished (the shutdown grace is over): the final
    /// commit records them as not started by this owner, and the revoke of leaving the group
    /// does not wait for them (the drain timeout would hold the exit, and the group, for
    /// nothing: the worker gave them up).
    pub(crate) fn hand_off_all(&self) {
        let mut state = self.lock();
        state.given_up = true;
        for p in state.partitions.values_mut() {
            p.hand_off();
        }
        drop(state);
        self.finished.notify_all();
    }

    /// Waits until the broker acknowledged version `version` of the starts of `origin`'s
    /// partition; false when `timeout` passed first or the assignment ended.
    pub(crate) async fn starts_recorded(&self, origin: &Origin, version: u64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.committed_now.notified();
            {
                let state = self.lock();
                match state.partitions.get(&TopicPartition::of(origin)) {
                    Some(p) if p.generation == origin.generation => {
                        if p.starts_confirmed >= version {
                            return true;
                        }
                    }
                    _ => return false,
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Asks for the lease of `origin`'s partition to reach `end` with the next commit, and wakes
    /// the committer.
    pub fn want_lease(&self, origin: &Origin, end: i64) {
        let mut state = self.lock();
        let Some(p) = state.partitions.get_mut(&TopicPartition::of(origin)) else {
            return;
        };
        if p.generation != origin.generation {
            return;
        }
        if let Some(lease) = &mut p.lease {
            lease.wanted = lease.wanted.max(end);
        }
        drop(state);
        self.commit_wanted.notify_one();
    }

    /// Waits until the broker acknowledged a lease of `origin`'s partition beyond `offset`;
    /// false when `timeout` passed first (noted: records are checked for a second) or the
    /// assignment ended.
    pub async fn lease_covers(&self, origin: &Origin, offset: i64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.committed_now.notified();
            match self.lease(origin) {
                LeaseState::Known { lease, .. } if lease.confirmed > offset => return true,
                LeaseState::Known { .. } => {}
                _ => return false,
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let mut state = self.lock();
                if let Some(p) = state.partitions.get_mut(&TopicPartition::of(origin)) {
                    p.lease_failed_at = Some(Instant::now());
                }
                return false;
            }
        }
    }

    /// Whether `origin`'s partition is being given up: draining for a revoke, or no longer this
    /// worker's (revoked, or assigned again since `origin` was read).
    pub fn is_handed_off(&self, origin: &Origin) -> bool {
        let state = self.lock();
        match state.partitions.get(&TopicPartition::of(origin)) {
            Some(p) => p.generation != origin.generation || matches!(p.phase, Phase::Draining { .. }),
            None => true,
        }
    }

    /// Whether work on `origin` goes on (to its next stage, or into a model call): yes while its
    /// partition is this worker's and consuming. A record of a draining partition is released
    /// instead, which is why this is not a plain question: it leaves the pending set unfinished
    /// (its offset is not committed; the next owner reads it again), so a revoke waits only for
    /// work in progress, not for everything buffered.
    pub fn keep_or_release(&self, origin: &Origin) -> bool {
        let mut state = self.lock();
        let tp = TopicPartition::of(origin);
        let Some(p) = state.partitions.get_mut(&tp) else {
            return false;
        };
        if p.generation != origin.generation {
            return false;
        }
        let Phase::Draining { released } = &mut p.phase else {
            return true;
        };
        if p.pending.finish(origin.offset).is_some() {
            p.started.remove(&origin.offset);
            *released = Some(released.map_or(origin.offset, |r| r.min(origin.offset)));
            state.in_flight -= 1;
            drop(state);
            self.finished.notify_all();
        }
        false
    }

    /// Records read and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    /// Records of `topic`'s partitions read and not yet finished.
    pub fn in_flight_of(&self, topic: &str) -> usize {
        let state = self.lock();
        state
            .partitions
            .iter()
            .filter(|(tp, _)| &*tp.topic == topic)
            .map(|(_, p)| p.pending.len())
            .sum()
    }

    /// Records read whose offsets are not committed yet, finished or not: what a new owner
    /// would read again if this consumer died now.
    pub fn uncommitted(&self) -> usize {
        let state = self.lock();
        state
            .partitions
            .values()
            .filter_map(|p| Some(p.pending.next()? - p.committed.or(p.first)?))
            .map(|n| n.max(0) as usize)
            .sum()
    }

    /// How long the oldest unfinished record has been in flight.
    pub fn oldest_age(&self) -> Option<Duration> {
        let state = self.lock();
        state
            .partitions
            .values()
            .flat_map(|p| p.pending.values())
            .min()
            .map(|t| t.elapsed())
    }

    /// The commits wanted now: offsets that moved, leases to extend. Partitions whose previous
    /// lease is not known yet are left out.
    pub fn commit_candidates(&self) -> Vec<Commit> {
        let state = self.lock();
        let mut out: Vec<_> = state.partitions.iter().filter_map(|(tp, p)| p.commit(tp)).collect();
        out.sort();
        out
    }

    /// Commits that record starts and nothing else: each partition with a start a model call
    /// waits for, at the offset it last committed (so none moves) with its lease and starts as
    /// metadata. For exactly-once delivery, where a plain commit between transactions is a
    /// round trip instead of a whole transaction. Partitions that have committed nothing under
    /// this assignment are left to the next transaction.
    pub(crate) fn start_candidates(&self) -> Vec<Commit> {
        let state = self.lock();
        let mut out: Vec<Commit> = state
            .partitions
            .iter()
            .filter(|(_, p)| p.starts_awaited > p.starts_confirmed)
            .filter_map(|(tp, p)| Some(p.commit_at(tp, p.committed?, p.lease?, false)))
            .collect();
        out.sort();
        out
    }

    /// Notes a successful commit.
    pub fn committed(&self, commits: &[Commit]) {
        let mut state = self.lock();
        for c in commits {
            if let Some(p) = state.partitions.get_mut(&c.tp).filter(|p| p.generation == c.generation) {
                p.committed = Some(p.committed.map_or(c.offset, |o| o.max(c.offset)));
                if let Some(lease) = &mut p.lease {
                    lease.confirmed = lease.confirmed.max(c.lease_end);
                }
                p.starts_confirmed = p.starts_confirmed.max(c.starts_version);
                for o in &c.done {
                    if p.done_new.remove(o) {
                        p.done_written.insert(*o);
                    }
                }
                if let Some(position) = p.committed {
                    p.done_written = p.done_written.split_off(&position);
                    p.done_new = p.done_new.split_off(&position);
                }
            }
        }
        drop(state);
        self.committed_now.notify_waiters();
    }

    /// The last committed offset of every assigned partition.
    pub fn committed_offsets(&self) -> Vec<(TopicPartition, Option<i64>)> {
        self.lock().partitions.iter().map(|(tp, p)| (tp.clone(), p.committed)).collect()
    }

    /// Blocks until every record of `partitions` is finished, `timeout` passes or the worker
    /// gives up what it runs ([`Offsets::hand_off_all`]). Returns how many are still pending.
    pub fn wait_drained(&self, partitions: &[TopicPartition], timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let pending = |state: &State| {
            partitions
                .iter()
                .filter_map(|tp| state.partitions.get(tp))
                .map(|p| p.pending.len())
                .sum::<usize>()
        };
        let mut state = self.lock();
        for tp in partitions {
            if let Some(p) = state.partitions.get_mut(tp)
                && p.phase == Phase::Consuming
            {
                p.phase = Phase::Draining { released: None };
            }
        }
        loop {
            let left = pending(&state);
            let now = Instant::now();
            if left == 0 || now >= deadline || state.given_up {
                return left;
            }
            state = self.finished.wait_timeout(state, deadline - now).expect("offsets lock").0;
        }
    }

    /// Stops tracking `partitions` and returns their final commits. Records still in flight are
    /// abandoned: their acknowledgements will be ignored, and the new owner reads them again
    /// from the committed offset.
    pub fn revoke(&self, partitions: &[TopicPartition]) -> Vec<Commit> {
        let mut state = self.lock();
        let mut out = Vec::new();
        for tp in partitions {
            if let Some(mut p) = state.partitions.remove(tp) {
                state.in_flight -= p.pending.len();
                // Records still running are handed off, not crashed: the next owner runs them
                // without counting this start.
                p.hand_off();
                out.extend(p.commit(tp));
            }
        }
        drop(state);
        self.finished.notify_all();
        out
    }

    /// Marks the leases of `partitions` known (none stored), as the redelivery check does on
    /// their first records.
    #[cfg(test)]
    pub(crate) fn lease_known(&self, partitions: &[TopicPartition]) {
        let mut state = self.lock();
        for tp in partitions {
            if let Some(p) = state.partitions.get_mut(tp) {
                p.lease.get_or_insert(Lease {
                    previous: 0,
                    wanted: 0,
                    confirmed: 0,
                });
            }
        }
    }

    /// Whether `offset` of `tp` is read and not yet finished.
    #[cfg(test)]
    pub(crate) fn is_pending(&self, tp: &TopicPartition, offset: i64) -> bool {
        self.lock().partitions.get(tp).is_some_and(|p| p.pending.is_pending(offset))
    }

    /// What the tracker holds, for the gauges.
    pub(crate) fn observed(&self) -> crate::events::OffsetsObserved {
        crate::events::OffsetsObserved {
            in_flight: self.in_flight(),
            uncommitted: self.uncommitted(),
            oldest: self.oldest_age(),
        }
    }

    /// Every assigned partition.
    pub fn assigned(&self) -> Vec<TopicPartition> {
        let mut v: Vec<_> = self.lock().partitions.keys().cloned().collect();
        v.sort();
        v
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

    /// Assigns `partitions` with their leases known.
    fn assign(offsets: &Offsets, partitions: &[TopicPartition]) {
        offsets.assign(partitions);
        offsets.lease_known(partitions);
    }

    fn pairs(commits: Vec<Commit>) -> Vec<(TopicPartition, i64)> {
        commits.into_iter().map(|c| (c.tp, c.offset)).collect()
    }

    /// A successful commit of `offset`, with what the partition has finished ahead of it.
    fn commit(offsets: &Offsets, tp: TopicPartition, offset: i64) {
        let commit = {
            let state = offsets.lock();
            let p = &state.partitions[&tp];
            Commit {
                lease_end: 0,
                started: BTreeMap::new(),
                starts_version: 0,
                ..p.commit_at(&tp, offset, p.lease.expect("known"), true)
            }
        };
        offsets.committed(&[commit]);
    }

    #[test]
    fn commits_only_below_the_lowest_unfinished_offset() {
        let offsets = Offsets::new();
        assign(&offsets, &[tp(0)]);
        let o: Vec<_> = (10..15).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 10)]);
        // Finish out of order: 12, 14, 10.
        assert!(offsets.ack(&o[2]) && offsets.ack(&o[4]) && offsets.ack(&o[0]));
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 11)]);
        commit(&offsets, tp(0), 11);
        assert!(offsets.commit_candidates().is_empty());
        assert!(offsets.ack(&o[1]));
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 13)]);
        assert!(offsets.ack(&o[3]));
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 15)]);
        assert_eq!(offsets.in_flight(), 0);
    }

    #[test]
    fn records_finished_ahead_of_the_position_are_committed_as_done_and_skipped_by_the_next_owner() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o: Vec<_> = (10..15).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        // Below the previous owner's lease: their starts are awaited, with plain commits.
        offsets.found_lease(&o[0], Ok(4096));
        commit(&offsets, tp(0), 10);
        // 12 and 13 finish while 10 still runs: a commit that leaves the position at 10 and
        // lists them.
        assert!(offsets.ack(&o[2]) && offsets.ack(&o[3]));
        // A plain commit of starts (between transactions) carries only what a commit carried.
        offsets.start(&[&o[0]]);
        assert!(offsets.start_candidates()[0].done.is_empty());
        let c = offsets.commit_candidates();
        assert_eq!((c[0].offset, c[0].done.clone()), (10, BTreeSet::from([12, 13])));
        assert_eq!(
            crate::source::done_ahead::done_metadata(&c[0].done),
            " done:12-13",
            "what the metadata says"
        );
        offsets.committed(&c);
        assert!(offsets.announced_ahead(&o[2]));
        offsets.start(&[&o[1]]);
        let s = offsets.start_candidates();
        assert_eq!(s[0].done, BTreeSet::from([12, 13]), "once carried, in every commit");
        offsets.committed(&s);
        assert!(offsets.commit_candidates().is_empty(), "nothing new finished");
        // A new owner (another process) reads the list with the lease and skips those records,
        // carrying them in its own commits until the position passes them.
        let next = Offsets::new();
        next.assign(&[tp(0)]);
        let n: Vec<_> = (10..15).map(|i| next.track(&tp(0), i).unwrap()).collect();
        next.found_done(&n[0], c[0].done.clone());
        next.found_lease(&n[0], Ok(0));
        assert!(!next.announced_ahead(&n[0]) && next.announced_ahead(&n[2]) && next.announced_ahead(&n[3]));
        assert!(next.ack(&n[2]) && next.ack(&n[3]) && next.ack(&n[4]));
        let c = next.commit_candidates();
        assert_eq!((c[0].offset, c[0].done.clone()), (10, BTreeSet::from([12, 13, 14])));
        next.committed(&c);
        assert!(next.ack(&n[0]) && next.ack(&n[1]));
        let c = next.commit_candidates();
        assert_eq!((c[0].offset, c[0].done.clone()), (15, BTreeSet::new()), "passed: the list is empty");
        next.committed(&c);
        assert!(next.lock().partitions[&tp(0)].done_written.is_empty(), "and forgotten");
    }

    #[test]
    fn a_start_is_taken_back_when_its_call_returns_or_its_record_is_handed_off() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o: Vec<_> = (0..3).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        // An earlier owner left 1 started twice.
        offsets.found_starts(&o[0], BTreeMap::from([(1, 2)]));
        offsets.found_lease(&o[0], Ok(0));
        offsets.start(&[&o[0], &o[1], &o[2]]);
        let started = |offsets: &Offsets| offsets.commit_candidates().pop().map(|c| c.started).unwrap_or_default();
        assert_eq!(started(&offsets), BTreeMap::from([(0, 1), (1, 3), (2, 1)]));
        // 0's call returned (its upload runs): a kill now is no crash of its.
        offsets.call_ended(&o[0]);
        assert_eq!(started(&offsets), BTreeMap::from([(1, 3), (2, 1)]));
        // The partition is revoked with 1 and 2 still in their call: handed off, the earlier
        // owner's count of 1 kept, this one's starts taken back.
        let last = offsets.revoke(&[tp(0)]);
        assert_eq!(last[0].started, BTreeMap::from([(1, 2)]));
    }

    #[test]
    fn only_a_start_an_earlier_owner_may_have_made_is_awaited() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0), tp(1)]);
        let a: Vec<_> = (8..12).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        let b = offsets.track(&tp(1), 3).unwrap();
        // The previous owner of partition 0 leased up to 10; partition 1 never had one.
        offsets.found_lease(&a[0], Ok(10));
        offsets.found_lease(&b, Ok(0));
        commit(&offsets, tp(0), 8);
        commit(&offsets, tp(1), 3);
        // 10, 11 and partition 1's 3 are new to the group: no wait, no plain commit of their
        // own, and the next regular commit carries their starts.
        assert!(offsets.start(&[&a[2], &a[3], &b]).is_empty());
        assert!(offsets.start_candidates().is_empty());
        let c = offsets.commit_candidates();
        assert_eq!(c.len(), 2, "both partitions' starts are due");
        assert_eq!(c[0].started, BTreeMap::from([(10, 1), (11, 1)]));
        assert_eq!(c[1].started, BTreeMap::from([(3, 1)]));
        offsets.committed(&c);
        // 9 may have been started by the earlier owner: its call waits for the record.
        let waits = offsets.start(&[&a[1]]);
        assert_eq!(waits.len(), 1);
        assert_eq!(waits[0].0.offset, 9);
        let s = offsets.start_candidates();
        assert_eq!((s[0].offset, s[0].started.clone()), (8, BTreeMap::from([(9, 1), (10, 1), (11, 1)])));
    }

    #[test]
    fn uncommitted_counts_finished_records_until_their_commit() {
        let offsets = Offsets::new();
        assign(&offsets, &[tp(0)]);
        let o: Vec<_> = (20..24).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert_eq!(offsets.uncommitted(), 4);
        assert!(offsets.ack(&o[0]) && offsets.ack(&o[1]));
        assert_eq!(offsets.in_flight(), 2);
        assert_eq!(offsets.uncommitted(), 4, "finished but not committed: read again after a crash");
        commit(&offsets, tp(0), 22);
        assert_eq!(offsets.uncommitted(), 2);
    }

    #[test]
    fn a_draining_partition_releases_unstarted_work_and_commits_below_it() {
        let offsets = Arc::new(Offsets::new());
        assign(&offsets, &[tp(0)]);
        let o: Vec<_> = (0..4).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert!(offsets.keep_or_release(&o[0]), "not draining: work starts");
        assert!(offsets.ack(&o[0]));
        // Record 1 is running when the revoke starts; 2 and 3 are still queued.
        let drainer = {
            let offsets = offsets.clone();
            std::thread::spawn(move || offsets.wait_drained(&[tp(0)], Duration::from_secs(10)))
        };
        while offsets.keep_or_release(&o[3]) {
            std::thread::yield_now(); // until the drain has begun
        }
        assert!(!offsets.keep_or_release(&o[2]), "queued work of a draining partition is released");
        assert!(offsets.is_handed_off(&o[2]), "and it is being handed off");
        assert!(offsets.ack(&o[1]), "work in progress finishes");
        assert_eq!(drainer.join().unwrap(), 0, "the drain waited only for record 1");
        // Records 2 and 3 were released unfinished: the commit stops at 2.
        assert_eq!(pairs(offsets.revoke(&[tp(0)])), vec![(tp(0), 2)]);
    }

    #[test]
    fn partitions_are_independent() {
        let offsets = Offsets::new();
        assign(&offsets, &[tp(0), tp(1)]);
        let a = offsets.track(&tp(0), 0).unwrap();
        let _b = offsets.track(&tp(1), 7).unwrap();
        assert!(offsets.ack(&a));
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 1), (tp(1), 7)]);
    }

    #[test]
    fn acks_from_a_revoked_assignment_are_ignored() {
        let offsets = Offsets::new();
        assign(&offsets, &[tp(0)]);
        let old = offsets.track(&tp(0), 5).unwrap();
        assert_eq!(pairs(offsets.revoke(&[tp(0)])), vec![(tp(0), 5)]);
        assert_eq!(offsets.in_flight(), 0);
        assign(&offsets, &[tp(0)]);
        assert!(!offsets.ack(&old), "an ack from before the revoke must not count");
        let new = offsets.track(&tp(0), 5).unwrap();
        assert!(offsets.ack(&new));
        assert_eq!(pairs(offsets.commit_candidates()), vec![(tp(0), 6)]);
    }

    #[test]
    fn records_of_unassigned_partitions_are_not_tracked() {
        let offsets = Offsets::new();
        assert!(offsets.track(&tp(3), 1).is_none());
        assert_eq!(offsets.in_flight(), 0);
    }

    #[test]
    fn wait_drained_returns_when_the_last_record_finishes() {
        let offsets = Arc::new(Offsets::new());
        assign(&offsets, &[tp(0)]);
        let o = offsets.track(&tp(0), 1).unwrap();
        let o2 = offsets.clone();
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            o2.ack(&o);
        });
        let started = Instant::now();
        assert_eq!(offsets.wait_drained(&[tp(0)], Duration::from_secs(10)), 0);
        assert!(started.elapsed() < Duration::from_secs(5));
        finisher.join().unwrap();
        // And gives up after the timeout with what is left.
        offsets.track(&tp(0), 2).unwrap();
        assert_eq!(offsets.wait_drained(&[tp(0)], Duration::from_millis(20)), 1);
    }

    #[test]
    fn once_the_shutdown_gives_work_up_a_revoke_waits_for_it_no_longer() {
        let offsets = Arc::new(Offsets::new());
        assign(&offsets, &[tp(0)]);
        let o = offsets.track(&tp(0), 1).unwrap();
        assert!(offsets.keep_or_release(&o), "record 1 runs");
        // A revoke already waiting for it (a rebalance during the shutdown grace) is released...
        let waiting = {
            let offsets = offsets.clone();
            std::thread::spawn(move || offsets.wait_drained(&[tp(0)], Duration::from_secs(60)))
        };
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        offsets.hand_off_all();
        assert_eq!(waiting.join().unwrap(), 1, "it is still running");
        // ... and the revoke of leaving the group does not wait at all.
        assert_eq!(offsets.wait_drained(&[tp(0)], Duration::from_secs(60)), 1);
        assert!(started.elapsed() < Duration::from_secs(30), "neither waited out its timeout");
        assert!(offsets.is_handed_off(&o), "handed off, not crashed");
    }

    #[test]
    fn nothing_commits_until_the_previous_lease_is_known() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o = offsets.track(&tp(0), 3).unwrap();
        assert!(offsets.ack(&o));
        assert!(offsets.commit_candidates().is_empty(), "a commit would overwrite the stored lease");
        offsets.found_lease(&o, Ok(40));
        let c = offsets.commit_candidates();
        assert_eq!((c[0].offset, c[0].lease_end), (4, 40), "the previous lease is written back");
    }

    #[tokio::test]
    async fn a_lease_extension_is_a_commit_even_when_no_offset_moved() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o = offsets.track(&tp(0), 0).unwrap();
        offsets.found_lease(&o, Ok(0));
        commit(&offsets, tp(0), 0);
        assert!(offsets.commit_candidates().is_empty());
        offsets.want_lease(&o, 16);
        let c = offsets.commit_candidates();
        assert_eq!((c[0].offset, c[0].lease_end), (0, 16));
        assert!(
            !offsets.lease_covers(&o, 0, Duration::from_millis(10)).await,
            "not acknowledged yet"
        );
        offsets.committed(&c);
        assert!(offsets.lease_covers(&o, 15, Duration::from_millis(10)).await);
        assert!(!offsets.lease_covers(&o, 16, Duration::from_millis(10)).await);
        assert!(offsets.commit_candidates().is_empty());
    }

    #[test]
    fn leases_belong_to_their_assignment() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let old = offsets.track(&tp(0), 0).unwrap();
        offsets.assign(&[tp(0)]);
        assert_eq!(offsets.lease(&old), LeaseState::Gone);
        offsets.found_lease(&old, Ok(9));
        let new = offsets.track(&tp(0), 0).unwrap();
        assert_eq!(
            offsets.lease(&new),
            LeaseState::Unknown { may_try: true },
            "a stale read is not kept"
        );
    }
}
