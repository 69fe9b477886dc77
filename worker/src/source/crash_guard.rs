//! The crash-loop guard: a record whose processing kills the worker (an abort or a segfault in
//! native code, an OOM kill: what no panic handler catches) must not kill every worker that
//! reads it after.
//!
//! When a model call starts, the records it holds are written into their partitions' commit
//! metadata next to the read lease ([`crate::source::redelivery`]), each with how many times it
//! has been started. A record an earlier owner may have started (below the lease that owner
//! committed) is a possible crash loop: its call waits until the broker has the record. A record
//! new to the group does not wait; its start rides along with the partition's next commit, and
//! should this worker die first, the next owner finds the record below this worker's lease (a
//! lease is committed before any record beyond it starts) and waits for it from then on. So a
//! record that kills every worker is started at most once more than the bound before it is
//! dead-lettered, and a fresh task's call never waits for a commit.
//!
//! A record leaves the set (back to its earlier owners' count) with the next commit once its
//! model call returns, with results or an error a handler saw, and when a drain gives it up
//! unfinished (handed off, not crashed): only an end inside the model call that nothing saw
//! counts. A new owner of the partition reads the set with the
//! lease: a record in it was in its model call when an earlier owner died. Such a record runs
//! again alone, in a call of its own and one suspect at a time, so that the tasks batched or
//! running with it are not blamed with it again; once it has been started
//! `SLUICE_MAX_CRASHES` times without an outcome, more than it has step checkpoints stored (each
//! a step a start reached: a task preempted while it gets on is not a crash loop), it goes to the
//! DLQ as `crashed` instead of running. A task that joins a running batch is marked started while
//! the call before the one it joins runs (it is made ready meanwhile:
//! [`crate::batching`]'s joiners), so a crash in that call counts for it too.
//!
//! The metadata is the list ` started:` ([`crate::source::offset_list`]), each offset with how
//! many times it was started. It is bounded: past [`MAX_METADATA_CHARS`] the highest offsets are
//! left out, and their crashes go uncounted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::source::offset_list;
use crate::source::offsets::Offsets;
use crate::source::record::Origin;

/// What decides a record's fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Never started before: runs as usual.
    Run,
    /// Started before without an outcome: runs in a call of its own.
    Alone { starts: u32 },
    /// Started `SLUICE_MAX_CRASHES` times without an outcome: to the DLQ.
    Crashed { starts: u32 },
}

/// The longest a model call waits for its starts to be recorded; after that it runs anyway
/// (the broker is away, and nothing else can be committed either).
const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

/// The most characters of started records in one commit's metadata.
pub(crate) const MAX_METADATA_CHARS: usize = 2900;

const MARKER: &str = " started:";

/// The guard of one worker.
pub(crate) struct CrashGuard {
    offsets: Arc<Offsets>,
    max_crashes: u32,
    /// Held by a suspect's call: suspects run one at a time, so that when one kills the
    /// process no other suspect's count goes up with it.
    alone: tokio::sync::Mutex<()>,
}

impl CrashGuard {
    /// `max_crashes` 0 turns the guard off: nothing is recorded, every record runs.
    pub(crate) fn new(offsets: Arc<Offsets>, max_crashes: u32) -> CrashGuard {
        CrashGuard {
            offsets,
            max_crashes,
            alone: tokio::sync::Mutex::new(()),
        }
    }

    /// The verdict on a record about to be batched, whose task has `progress` step checkpoints
    /// stored. Started before: it runs alone. It goes to the DLQ once its starts without
    /// progress reach `max_crashes`: each stored checkpoint is a step a start reached, so it
    /// excuses one start. A task preempted again and again while it gets on carries on; one
    /// that kills its worker at the same step every time stops after `max_crashes` starts more
    /// than its checkpoints, a bounded number.
    pub(crate) fn verdict(&self, origin: &Origin, progress: u32) -> Verdict {
        if self.max_crashes == 0 {
            return Verdict::Run;
        }
        match self.offsets.previous_starts(origin) {
            0 => Verdict::Run,
            starts if starts.saturating_sub(progress) >= self.max_crashes => Verdict::Crashed { starts },
            starts => Verdict::Alone { starts },
        }
    }

    /// Waits until no other suspect runs; the guard is held for the suspect's call.
    pub(crate) async fn alone(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.alone.lock().await
    }

    /// Records that `origins` start now; returns once the broker has acknowledged the starts of
    /// those an earlier owner may have started (or after [`RECORD_TIMEOUT`], with a warning).
    /// The others are committed with their partitions' next commit.
    pub(crate) async fn starting(&self, origins: &[&Origin]) {
        if self.max_crashes == 0 {
            return;
        }
        for (origin, version) in self.offsets.start(origins) {
            if !self.offsets.starts_recorded(&origin, version, RECORD_TIMEOUT).await {
                tracing::warn!(
                    partition = origin.partition,
                    offset = origin.offset,
                    "could not record the start of a model call; running it unrecorded (a crash in it goes uncounted)"
                );
            }
        }
    }
}

/// The metadata suffix that records `started` (empty when nothing is).
pub(crate) fn starts_metadata(started: &BTreeMap<i64, u32>) -> String {
    offset_list::encode(MARKER, started.iter().map(|(o, n)| (*o, *n)), MAX_METADATA_CHARS).0
}

/// The started records in a commit's metadata (none when it has none, or was written by another
/// tool); malformed entries are skipped, and the number of offsets read is bounded.
pub(crate) fn parse_starts(metadata: &str) -> BTreeMap<i64, u32> {
    offset_list::parse(metadata, MARKER)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::offsets::TopicPartition;

    fn tp() -> TopicPartition {
        TopicPartition {
            topic: "t".into(),
            partition: 0,
        }
    }

    #[test]
    fn started_records_survive_the_metadata_round_trip() {
        let started: BTreeMap<i64, u32> = [(5, 1), (6, 1), (7, 1), (9, 2), (10, 2), (12, 1), (40, 3)].into();
        let text = starts_metadata(&started);
        assert_eq!(text, " started:5-7,9-10*2,12,40*3");
        let metadata = format!("{}{text}", crate::source::redelivery::lease_metadata(4096));
        assert_eq!(parse_starts(&metadata), started);
        assert_eq!(
            crate::source::redelivery::parse_lease_metadata(&metadata),
            4096,
            "the lease reads as before"
        );
        assert_eq!(starts_metadata(&BTreeMap::new()), "");
        assert!(
            parse_starts(&crate::source::redelivery::lease_metadata(7)).is_empty(),
            "older metadata has none"
        );
    }

    #[test]
    fn the_metadata_is_bounded_both_ways() {
        // Every other offset: no ranges, the longest encoding.
        let many: BTreeMap<i64, u32> = (0..10_000).map(|i| (1_000_000_000 + 2 * i, 1)).collect();
        let text = starts_metadata(&many);
        assert!(text.len() <= MAX_METADATA_CHARS, "{}", text.len());
        let back = parse_starts(&text);
        assert!(
            !back.is_empty() && back.iter().all(|(o, n)| many.get(o) == Some(n)),
            "the lowest are kept"
        );
        // Hostile metadata: a huge range, junk, zero counts, negative offsets.
        let hostile = " started:0-9000000000000,x,-5,3*0,7*abc,9-2";
        assert_eq!(parse_starts(hostile).len(), 16_384);
        assert!(parse_starts(" started:x,-5,3*0,7*abc,9-2").is_empty());
    }

    #[tokio::test]
    async fn counts_carry_over_owners_and_the_guard_decides_on_them() {
        let offsets = Arc::new(Offsets::new());
        offsets.assign(&[tp()]);
        let o: Vec<Origin> = (0..4).map(|i| offsets.track(&tp(), i).unwrap()).collect();
        // The previous owner left 1 started twice and 2 started three times.
        offsets.found_starts(&o[0], parse_starts(" started:1*2,2*3"));
        offsets.found_lease(&o[0], Ok(4096));
        let guard = CrashGuard::new(offsets.clone(), 3);
        assert_eq!(guard.verdict(&o[0], 0), Verdict::Run);
        assert_eq!(guard.verdict(&o[1], 0), Verdict::Alone { starts: 2 });
        assert_eq!(guard.verdict(&o[2], 0), Verdict::Crashed { starts: 3 });
        // Step checkpoints stored are progress: each excuses a start, and the rest still count.
        assert_eq!(guard.verdict(&o[2], 1), Verdict::Alone { starts: 3 });
        assert_eq!(
            guard.verdict(&o[1], 5),
            Verdict::Alone { starts: 2 },
            "started before: alone all the same"
        );
        assert_eq!(
            CrashGuard::new(offsets.clone(), 0).verdict(&o[2], 0),
            Verdict::Run,
            "0 turns it off"
        );
        // Carried into this owner's first commit as found.
        let c = offsets.commit_candidates();
        assert_eq!(c[0].started, BTreeMap::from([(1, 2), (2, 3)]));
        // Starting 0 and 1 records them (1 a third time) and wants a commit; the call waits
        // for its acknowledgement.
        let waits = offsets.start(&[&o[0], &o[1]]);
        assert_eq!(waits.len(), 1, "one wait per partition");
        let c = offsets.commit_candidates();
        assert_eq!(c[0].started, BTreeMap::from([(0, 1), (1, 3), (2, 3)]));
        assert!(!offsets.starts_recorded(&waits[0].0, waits[0].1, Duration::from_millis(10)).await);
        offsets.committed(&c);
        assert!(offsets.starts_recorded(&waits[0].0, waits[0].1, Duration::from_millis(10)).await);
        // Finished records leave the set (2 is failed as crashed: it finishes too).
        assert!(offsets.ack(&o[0]) && offsets.ack(&o[2]));
        let c = offsets.commit_candidates();
        assert_eq!((c[0].offset, c[0].started.clone()), (1, BTreeMap::from([(1, 3)])));
        // Exactly-once records a start with a plain commit that moves no offset: at the one
        // last committed (0), not at the one a transaction would commit (1).
        assert!(offsets.start_candidates().is_empty());
        offsets.start(&[&o[3]]);
        let s = offsets.start_candidates();
        assert_eq!((s[0].offset, s[0].started.clone()), (0, BTreeMap::from([(1, 3), (3, 1)])));
    }
}
