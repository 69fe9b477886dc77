//! Read leases: which records could have been started before, so need the idempotency check.
//!
//! Checking every task's result manifest before running it costs a storage round trip per task,
//! yet only redelivered records can have results. A consumer never starts a record at or beyond
//! its partition's *lease end* without first recording a larger one in storage; so when a
//! partition is assigned, every record below the stored lease end may have been started by an
//! earlier owner and is checked, and every record at or beyond it is new and runs at once.
//! Replayed and redriven records (header `sluice-origin`) are always checked. Kafka's own offset
//! commit metadata would be the natural home of the lease, but the local broker drops it, so
//! the lease lives beside the results, one small object per group and partition.

use std::collections::HashMap;
use std::time::Duration;

use crate::offsets::TopicPartition;
use crate::sink::Sink;

/// Records a lease covers beyond the record that extended it.
pub const LEASE_SPAN: i64 = 4096;

pub use sluice_schemas::HEADER_ORIGIN;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Partition {
    /// The lease end found in storage at assignment (0 when there was none); `None` while it
    /// could not be read.
    previous: Option<i64>,
    /// This consumer may start records below this without writing a new lease.
    lease_end: i64,
}

/// What the lease logic decides for one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Check for existing results before running it.
    pub check: bool,
    /// Write this lease end before starting the record.
    pub extend_to: Option<i64>,
}

/// Lease state of the assigned partitions. Pure bookkeeping; [`Leases`] adds the storage.
#[derive(Debug, Default)]
pub struct LeaseTable {
    partitions: HashMap<TopicPartition, Partition>,
}

impl LeaseTable {
    /// A partition was assigned. `previous` is the stored lease end (`Some(None)`: none stored),
    /// or `None` when storage could not be read.
    pub fn assign(&mut self, tp: TopicPartition, previous: Option<Option<i64>>) {
        self.partitions.insert(
            tp,
            Partition {
                previous: previous.map(|p| p.unwrap_or(0)),
                lease_end: 0,
            },
        );
    }

    pub fn revoke(&mut self, tp: &TopicPartition) {
        self.partitions.remove(tp);
    }

    /// Whether the previous lease of `tp` is still unknown.
    pub fn unknown(&self, tp: &TopicPartition) -> bool {
        self.partitions.get(tp).is_some_and(|p| p.previous.is_none())
    }

    /// Decides for the record at `offset`. When `extend_to` is set, the caller records it and
    /// then calls [`LeaseTable::extended`]. While the previous lease is unknown every record is
    /// checked and no lease is written: a new one must never be smaller than the old.
    pub fn admit(&self, tp: &TopicPartition, offset: i64, replayed: bool) -> Admission {
        match self.partitions.get(tp) {
            Some(Partition {
                previous: Some(previous),
                lease_end,
            }) => Admission {
                check: replayed || offset < *previous,
                extend_to: (offset >= *lease_end).then(|| (offset + LEASE_SPAN).max(*previous)),
            },
            _ => Admission {
                check: true,
                extend_to: None,
            },
        }
    }

    /// The lease up to `end` was recorded.
    pub fn extended(&mut self, tp: &TopicPartition, end: i64) {
        if let Some(p) = self.partitions.get_mut(tp) {
            p.lease_end = p.lease_end.max(end);
        }
    }
}

/// Leases backed by the object store, for the poll thread (which is not on the async runtime).
pub struct Leases {
    table: LeaseTable,
    sink: Sink,
    group: String,
    runtime: tokio::runtime::Handle,
    /// When an unreadable or unwritable lease was last tried, to retry at most once a second.
    last_failure: Option<std::time::Instant>,
}

impl Leases {
    pub fn new(sink: Sink, group: String, runtime: tokio::runtime::Handle) -> Leases {
        Leases {
            table: LeaseTable::default(),
            sink,
            group,
            runtime,
            last_failure: None,
        }
    }

    fn block_on<T>(&self, f: impl Future<Output = T>) -> Option<T> {
        self.runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), f).await.ok() })
    }

    fn may_retry(&self) -> bool {
        self.last_failure.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
    }

    fn read(&mut self, tp: &TopicPartition) {
        match self.block_on(self.sink.lease(&self.group, &tp.topic, tp.partition)) {
            Some(Ok(previous)) => self.table.assign(tp.clone(), Some(previous)),
            other => {
                tracing::warn!(partition = tp.partition, error = ?other.map(|r| r.err()), "read lease unreadable; checking records for earlier results until it can be read");
                self.table.assign(tp.clone(), None);
                self.last_failure = Some(std::time::Instant::now());
            }
        }
    }

    pub fn assign(&mut self, tp: &TopicPartition) {
        self.read(tp);
    }

    pub fn revoke(&mut self, tp: &TopicPartition) {
        self.table.revoke(tp);
    }

    /// Whether the record at `offset` needs the idempotency check; extends the lease first when
    /// the record is beyond it.
    pub fn admit(&mut self, tp: &TopicPartition, offset: i64, replayed: bool) -> bool {
        if self.table.unknown(tp) && self.may_retry() {
            self.read(tp);
        }
        let admission = self.table.admit(tp, offset, replayed);
        let Some(end) = admission.extend_to else { return admission.check };
        if !self.may_retry() {
            return true;
        }
        match self.block_on(self.sink.put_lease(&self.group, &tp.topic, tp.partition, end)) {
            Some(Ok(())) => {
                self.table.extended(tp, end);
                self.last_failure = None;
                admission.check
            }
            other => {
                tracing::warn!(partition = tp.partition, end, error = ?other.map(|r| r.err()), "could not record the read lease; checking records until it can be");
                self.last_failure = Some(std::time::Instant::now());
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp() -> TopicPartition {
        TopicPartition {
            topic: "t".into(),
            partition: 0,
        }
    }

    #[test]
    fn records_below_the_previous_lease_are_checked_the_rest_are_not() {
        let mut t = LeaseTable::default();
        t.assign(tp(), Some(Some(100)));
        let a = t.admit(&tp(), 40, false);
        assert!(a.check);
        assert_eq!(a.extend_to, Some(40 + LEASE_SPAN), "extends past the record");
        t.extended(&tp(), 40 + LEASE_SPAN);
        assert!(t.admit(&tp(), 99, false).check);
        assert_eq!(
            t.admit(&tp(), 100, false),
            Admission {
                check: false,
                extend_to: None
            }
        );
        assert!(t.admit(&tp(), 100, true).check, "replayed records are always checked");
    }

    #[test]
    fn a_new_lease_never_ends_before_the_previous_one() {
        let mut t = LeaseTable::default();
        t.assign(tp(), Some(Some(10 * LEASE_SPAN)));
        assert_eq!(t.admit(&tp(), 3, false).extend_to, Some(10 * LEASE_SPAN));
    }

    #[test]
    fn the_lease_is_extended_before_a_record_beyond_it() {
        let mut t = LeaseTable::default();
        t.assign(tp(), Some(None));
        let first = t.admit(&tp(), 0, false);
        assert_eq!(
            first,
            Admission {
                check: false,
                extend_to: Some(LEASE_SPAN)
            }
        );
        t.extended(&tp(), LEASE_SPAN);
        assert_eq!(t.admit(&tp(), LEASE_SPAN - 1, false).extend_to, None);
        assert_eq!(t.admit(&tp(), LEASE_SPAN, false).extend_to, Some(2 * LEASE_SPAN));
    }

    #[test]
    fn an_unreadable_lease_means_checking_everything_and_writing_nothing() {
        let mut t = LeaseTable::default();
        t.assign(tp(), None);
        assert!(t.unknown(&tp()));
        assert_eq!(
            t.admit(&tp(), 1_000_000, false),
            Admission {
                check: true,
                extend_to: None
            }
        );
    }

    #[test]
    fn unassigned_partitions_are_checked() {
        let t = LeaseTable::default();
        assert!(t.admit(&tp(), 0, false).check);
    }
}
