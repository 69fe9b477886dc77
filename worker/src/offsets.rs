//! Ordered offset tracking: per partition, offset N is committed only once every record below N
//! has been finished (its completion or DLQ record acknowledged by the broker).
//!
//! Tasks finish out of order — inside a batch, across batches, and when a poison record goes to
//! the DLQ at once — so the committable offset of a partition is the lowest offset still
//! pending, or one past the last record read when none is.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::task::Origin;

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

#[derive(Debug)]
struct Partition {
    generation: u64,
    /// Offsets read and not yet finished, with when they were read.
    pending: BTreeMap<i64, Instant>,
    /// One past the highest offset read.
    next: Option<i64>,
    /// The first offset read under this assignment.
    first: Option<i64>,
    /// The last offset committed (the next record to read after a restart).
    committed: Option<i64>,
    /// Being revoked: work not yet started on it is released rather than run.
    draining: bool,
    /// The lowest offset released unfinished while draining: commits stop below it.
    released: Option<i64>,
}

impl Partition {
    fn committable(&self) -> Option<i64> {
        let c = self.pending.keys().next().copied().or(self.next)?;
        Some(self.released.map_or(c, |r| r.min(c)))
    }
}

#[derive(Debug, Default)]
struct State {
    partitions: HashMap<TopicPartition, Partition>,
    generation: u64,
    in_flight: usize,
}

/// The tracker. Shared by the source thread (which tracks records as it reads them and drains
/// partitions on revoke), the stages (which acknowledge) and the committer.
#[derive(Debug, Default)]
pub struct Offsets {
    state: Mutex<State>,
    finished: Condvar,
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
                    pending: BTreeMap::new(),
                    next: None,
                    first: None,
                    committed: None,
                    draining: false,
                    released: None,
                },
            );
        }
    }

    /// Records that `offset` was read. Returns its origin, or `None` when the partition is not
    /// assigned (a record that raced a revoke; it will be read again by the new owner).
    pub fn track(&self, tp: &TopicPartition, offset: i64) -> Option<Origin> {
        let mut state = self.lock();
        let partition = state.partitions.get_mut(tp)?;
        if partition.pending.insert(offset, Instant::now()).is_some() {
            return None; // read twice under one assignment (a seek); the first one is in flight
        }
        partition.next = Some(partition.next.map_or(offset + 1, |n| n.max(offset + 1)));
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
        if partition.generation != origin.generation || partition.pending.remove(&origin.offset).is_none() {
            return false;
        }
        state.in_flight -= 1;
        drop(state);
        self.finished.notify_all();
        true
    }

    /// Whether work on `origin` should start: it belongs to a current assignment that is not
    /// being drained. A record of a draining partition is released instead (its offset is not
    /// committed; the next owner reads it again), so a revoke waits only for work in progress,
    /// not for everything buffered.
    pub fn should_start(&self, origin: &Origin) -> bool {
        let mut state = self.lock();
        let tp = TopicPartition::of(origin);
        let Some(p) = state.partitions.get_mut(&tp) else {
            return false;
        };
        if p.generation != origin.generation {
            return false;
        }
        if !p.draining {
            return true;
        }
        if p.pending.remove(&origin.offset).is_some() {
            p.released = Some(p.released.map_or(origin.offset, |r| r.min(origin.offset)));
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

    /// Records read whose offsets are not committed yet, finished or not: what a new owner
    /// would read again if this consumer died now.
    pub fn uncommitted(&self) -> usize {
        let state = self.lock();
        state
            .partitions
            .values()
            .filter_map(|p| Some(p.next? - p.committed.or(p.first)?))
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

    /// Offsets that can be committed and differ from the last commit.
    pub fn commit_candidates(&self) -> Vec<(TopicPartition, i64)> {
        let state = self.lock();
        let mut out: Vec<_> = state
            .partitions
            .iter()
            .filter_map(|(tp, p)| {
                let c = p.committable()?;
                (p.committed != Some(c)).then(|| (tp.clone(), c))
            })
            .collect();
        out.sort();
        out
    }

    /// Notes a successful commit.
    pub fn committed(&self, commits: &[(TopicPartition, i64)]) {
        let mut state = self.lock();
        for (tp, offset) in commits {
            if let Some(p) = state.partitions.get_mut(tp) {
                p.committed = Some(p.committed.map_or(*offset, |c| c.max(*offset)));
            }
        }
    }

    /// The last committed offset of every assigned partition.
    pub fn committed_offsets(&self) -> Vec<(TopicPartition, Option<i64>)> {
        self.lock().partitions.iter().map(|(tp, p)| (tp.clone(), p.committed)).collect()
    }

    /// Blocks until every record of `partitions` is finished or `timeout` passes. Returns how
    /// many are still pending.
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
            if let Some(p) = state.partitions.get_mut(tp) {
                p.draining = true;
            }
        }
        loop {
            let left = pending(&state);
            let now = Instant::now();
            if left == 0 || now >= deadline {
                return left;
            }
            state = self.finished.wait_timeout(state, deadline - now).expect("offsets lock").0;
        }
    }

    /// Stops tracking `partitions` and returns their final commit candidates. Records still in
    /// flight are abandoned: their acknowledgements will be ignored, and the new owner reads them
    /// again from the committed offset.
    pub fn revoke(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, i64)> {
        let mut state = self.lock();
        let mut out = Vec::new();
        for tp in partitions {
            if let Some(p) = state.partitions.remove(tp) {
                state.in_flight -= p.pending.len();
                if let Some(c) = p.committable().filter(|c| p.committed != Some(*c)) {
                    out.push((tp.clone(), c));
                }
            }
        }
        drop(state);
        self.finished.notify_all();
        out
    }

    /// Whether `offset` of `tp` is read and not yet finished.
    #[cfg(test)]
    pub(crate) fn is_pending(&self, tp: &TopicPartition, offset: i64) -> bool {
        self.lock().partitions.get(tp).is_some_and(|p| p.pending.contains_key(&offset))
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

    #[test]
    fn commits_only_below_the_lowest_unfinished_offset() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o: Vec<_> = (10..15).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 10)]);
        // Finish out of order: 12, 14, 10.
        assert!(offsets.ack(&o[2]) && offsets.ack(&o[4]) && offsets.ack(&o[0]));
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 11)]);
        offsets.committed(&[(tp(0), 11)]);
        assert!(offsets.commit_candidates().is_empty());
        assert!(offsets.ack(&o[1]));
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 13)]);
        assert!(offsets.ack(&o[3]));
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 15)]);
        assert_eq!(offsets.in_flight(), 0);
    }

    #[test]
    fn uncommitted_counts_finished_records_until_their_commit() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let o: Vec<_> = (20..24).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert_eq!(offsets.uncommitted(), 4);
        assert!(offsets.ack(&o[0]) && offsets.ack(&o[1]));
        assert_eq!(offsets.in_flight(), 2);
        assert_eq!(offsets.uncommitted(), 4, "finished but not committed: read again after a crash");
        offsets.committed(&[(tp(0), 22)]);
        assert_eq!(offsets.uncommitted(), 2);
    }

    #[test]
    fn a_draining_partition_releases_unstarted_work_and_commits_below_it() {
        let offsets = Arc::new(Offsets::new());
        offsets.assign(&[tp(0)]);
        let o: Vec<_> = (0..4).map(|i| offsets.track(&tp(0), i).unwrap()).collect();
        assert!(offsets.should_start(&o[0]), "not draining: work starts");
        assert!(offsets.ack(&o[0]));
        // Record 1 is running when the revoke starts; 2 and 3 are still queued.
        let drainer = {
            let offsets = offsets.clone();
            std::thread::spawn(move || offsets.wait_drained(&[tp(0)], Duration::from_secs(10)))
        };
        while offsets.should_start(&o[3]) {
            std::thread::yield_now(); // until the drain has begun
        }
        assert!(!offsets.should_start(&o[2]), "queued work of a draining partition is released");
        assert!(offsets.ack(&o[1]), "work in progress finishes");
        assert_eq!(drainer.join().unwrap(), 0, "the drain waited only for record 1");
        // Records 2 and 3 were released unfinished: the commit stops at 2.
        assert_eq!(offsets.revoke(&[tp(0)]), vec![(tp(0), 2)]);
    }

    #[test]
    fn partitions_are_independent() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0), tp(1)]);
        let a = offsets.track(&tp(0), 0).unwrap();
        let _b = offsets.track(&tp(1), 7).unwrap();
        assert!(offsets.ack(&a));
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 1), (tp(1), 7)]);
    }

    #[test]
    fn acks_from_a_revoked_assignment_are_ignored() {
        let offsets = Offsets::new();
        offsets.assign(&[tp(0)]);
        let old = offsets.track(&tp(0), 5).unwrap();
        assert_eq!(offsets.revoke(&[tp(0)]), vec![(tp(0), 5)]);
        assert_eq!(offsets.in_flight(), 0);
        offsets.assign(&[tp(0)]);
        assert!(!offsets.ack(&old), "an ack from before the revoke must not count");
        let new = offsets.track(&tp(0), 5).unwrap();
        assert!(offsets.ack(&new));
        assert_eq!(offsets.commit_candidates(), vec![(tp(0), 6)]);
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
        offsets.assign(&[tp(0)]);
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
}
