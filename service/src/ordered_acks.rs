//! Ordered acknowledgement of one partition's records (vector's `OrderedFinalizer` is the
//! model): records are read in offset order and finished in any order, and the offset that may
//! be committed is the lowest one still pending, or one past the highest read when none is. The
//! worker's offset tracker (tasks) and the producer's webhook notifier (events) both commit this
//! way; each keeps one of these per partition under its own notion of an assignment.

use std::collections::BTreeMap;

/// One partition's records read and not yet finished, each with what its owner keeps of it
/// (when it was read, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderedAcks<T> {
    pending: BTreeMap<i64, T>,
    /// One past the highest offset read.
    next: Option<i64>,
}

impl<T> Default for OrderedAcks<T> {
    fn default() -> Self {
        OrderedAcks {
            pending: BTreeMap::new(),
            next: None,
        }
    }
}

impl<T> OrderedAcks<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `offset` was read. False, and nothing changes, when it is already pending
    /// (read twice: the first reading is in flight).
    pub fn read(&mut self, offset: i64, value: T) -> bool {
        if self.pending.contains_key(&offset) {
            return false;
        }
        self.pending.insert(offset, value);
        self.next = Some(self.next.map_or(offset + 1, |n| n.max(offset + 1)));
        true
    }

    /// Marks `offset` finished; what was kept of it, or `None` when it was not pending.
    pub fn finish(&mut self, offset: i64) -> Option<T> {
        self.pending.remove(&offset)
    }

    /// The offset to commit: the lowest pending, or one past the highest read; `None` before
    /// anything was read.
    pub fn committable(&self) -> Option<i64> {
        self.pending.keys().next().copied().or(self.next)
    }

    /// One past the highest offset read.
    pub fn next(&self) -> Option<i64> {
        self.next
    }

    /// Whether `offset` is read and not finished.
    pub fn is_pending(&self, offset: i64) -> bool {
        self.pending.contains_key(&offset)
    }

    /// How many records are read and not finished.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// What is kept of each pending record, in offset order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.pending.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committable_offset_stops_at_the_lowest_unfinished_record() {
        let mut acks = OrderedAcks::new();
        assert_eq!(acks.committable(), None, "nothing read");
        for offset in [10, 11, 13] {
            assert!(acks.read(offset, offset * 2));
        }
        assert!(!acks.read(11, 0), "read twice: the first reading stays");
        assert_eq!(acks.committable(), Some(10));
        assert_eq!(acks.finish(11), Some(22));
        assert_eq!(acks.committable(), Some(10), "10 is still pending");
        assert_eq!(acks.finish(11), None, "finished once");
        assert_eq!(acks.finish(10), Some(20));
        assert_eq!(acks.committable(), Some(13), "past the gap at 12 (never read)");
        assert_eq!(acks.len(), 1);
        assert!(acks.is_pending(13));
        assert_eq!(acks.finish(13), Some(26));
        assert_eq!(acks.committable(), Some(14), "all finished: one past the highest read");
        assert!(acks.is_empty());
        assert!(acks.read(12, 0), "an earlier offset read later");
        assert_eq!((acks.committable(), acks.next()), (Some(12), Some(14)));
    }
}
