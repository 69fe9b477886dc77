//! Records finished ahead of their partition's committed position, recorded in the commit
//! metadata (the list ` done:`, [`crate::source::offset_list`]) so that an outcome is announced
//! when its task finishes, not when every earlier record of its partition has.
//!
//! A partition commits in order: its committed offset is the lowest record not finished, so one
//! slow task holds the position while later ones finish. In exactly-once mode a finished task's
//! records used to wait in the outbox until the position passed them, which made a 0.3 s task's
//! completion wait for a 30 s neighbour. Now the transaction that carries a finished task's
//! records also commits its partition's offset (unchanged) with that record's offset in this
//! list, in the same atomic step. A new owner, after a kill or a rebalance, reads the list with
//! the read lease and skips those records: it neither runs nor announces them again. At least
//! once, the list is written too (outcomes were acknowledged before their offsets), and a new
//! owner runs fewer tasks twice.
//!
//! Bounded: the list gets at most [`MAX_METADATA_CHARS`] characters of the commit metadata (the
//! lease and the started records use the rest of the broker's 4 KiB). Past it, the highest
//! finished offsets are left out: at least once they are run again by a new owner, as before;
//! exactly once their records wait in the outbox, as before, until the position or the list
//! reaches them. A partition whose tasks finish in order never writes the list at all.

use std::collections::BTreeSet;

use crate::source::offset_list;

const MARKER: &str = " done:";

/// The most characters of finished records in one commit's metadata.
pub(crate) const MAX_METADATA_CHARS: usize = 1100;

/// The metadata suffix that records `done` (empty when nothing is). Callers pass what
/// [`bounded`] kept, so nothing is cut here.
pub(crate) fn done_metadata(done: &BTreeSet<i64>) -> String {
    offset_list::encode(MARKER, done.iter().map(|o| (*o, 1)), MAX_METADATA_CHARS).0
}

/// The lowest offsets of `done` (ascending) that fit in the metadata.
pub(crate) fn bounded<'a>(done: impl Iterator<Item = &'a i64> + Clone) -> BTreeSet<i64> {
    let (_, fitted) = offset_list::encode(MARKER, done.clone().map(|o| (*o, 1)), MAX_METADATA_CHARS);
    done.take(fitted).copied().collect()
}

/// The records a commit's metadata says were finished ahead of its offset.
pub(crate) fn parse_done(metadata: &str) -> BTreeSet<i64> {
    offset_list::parse(metadata, MARKER).into_keys().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_records_survive_the_round_trip_and_are_bounded() {
        let done: BTreeSet<i64> = [5, 6, 7, 9].into();
        assert_eq!(done_metadata(&done), " done:5-7,9");
        assert_eq!(parse_done(&format!("sluice-lease:100 started:4{}", done_metadata(&done))), done);
        // Every other offset, the longest encoding: the lowest are kept, within the budget.
        let many: BTreeSet<i64> = (0..5_000).map(|i| 1_000_000_000 + 2 * i).collect();
        let kept = bounded(many.iter());
        assert!(!kept.is_empty() && kept.len() < many.len());
        assert_eq!(kept.iter().max(), many.iter().take(kept.len()).max(), "the lowest");
        assert!(done_metadata(&kept).len() <= MAX_METADATA_CHARS);
        assert_eq!(parse_done(&done_metadata(&kept)), kept);
    }
}
