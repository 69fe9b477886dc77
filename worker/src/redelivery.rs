//! The redelivery check: which records may have been started by an earlier delivery, so that
//! their results may already exist and must be looked up (the result manifest) before they run.
//!
//! Checking every task's manifest would cost a storage round trip per task, yet only redelivered
//! records can have results. [`RedeliveryCheck`] decides per record; it is asked by the decode
//! stage, on the async runtime, never by the Kafka poll thread, so a slow or unreachable store
//! never stalls polling (nor costs the worker its group membership).
//!
//! Today's implementation, [`ObjectStoreLeases`], keeps a *read lease* per partition beside the
//! results: a consumer never starts a record at or beyond its partition's lease end without first
//! recording a larger one. So on a new assignment every record below the stored lease end may
//! have been started by an earlier owner and is checked, and every record at or beyond it is new
//! and runs at once. Replayed and redriven records (header `sluice-origin`) are always checked.
//!
//! A broker that keeps commit metadata (Apache Kafka does; the local broker drops it) would carry
//! the lease end in the metadata of each offset commit instead: an implementation reads the
//! committed offset's metadata at assignment and writes the new lease end with the next commit,
//! with no storage objects at all. It plugs in here, as another `RedeliveryCheck`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use crate::offsets::TopicPartition;
use crate::sink::Sink;
use crate::task::Origin;

/// Decides, per record, whether an earlier delivery may have started it.
pub trait RedeliveryCheck: Send + Sync {
    /// Whether the record at `origin` needs the idempotency check before it runs. Called before
    /// the record starts, in offset order per partition. `replayed`: the record was copied back
    /// by replay or redrive.
    fn admit<'a>(&'a self, origin: &'a Origin, replayed: bool) -> BoxFuture<'a, bool>;
}

/// Records a lease covers beyond the record that extended it.
pub const LEASE_SPAN: i64 = 4096;

/// The longest a lease read or write may take before the record is checked instead.
const LEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// After a failed lease read or write, how long to check records instead of trying again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Partition {
    /// The assignment this state belongs to.
    generation: u64,
    /// The lease end found in storage at assignment (0 when there was none); `None` while it
    /// could not be read.
    previous: Option<i64>,
    /// This consumer may start records below this without writing a new lease.
    lease_end: i64,
    /// When a lease read or write last failed.
    failed_at: Option<Instant>,
}

impl Partition {
    fn may_try(&self) -> bool {
        self.failed_at.is_none_or(|t| t.elapsed() >= RETRY_AFTER)
    }
}

/// What the lease logic decides for one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Admission {
    /// Check for existing results before running it.
    check: bool,
    /// Write this lease end before starting the record.
    extend_to: Option<i64>,
}

/// Lease state of the partitions seen under their current assignment. Pure bookkeeping;
/// [`ObjectStoreLeases`] adds the storage.
#[derive(Debug)]
struct LeaseTable {
    span: i64,
    partitions: HashMap<TopicPartition, Partition>,
}

impl LeaseTable {
    fn new(span: i64) -> LeaseTable {
        LeaseTable {
            span: span.max(1),
            partitions: HashMap::new(),
        }
    }

    /// The state of `origin`'s partition, fresh when the record comes from a new assignment.
    fn state(&mut self, origin: &Origin) -> &mut Partition {
        let fresh = Partition {
            generation: origin.generation,
            previous: None,
            lease_end: 0,
            failed_at: None,
        };
        let p = self.partitions.entry(TopicPartition::of(origin)).or_insert(fresh);
        if p.generation != origin.generation {
            *p = fresh;
        }
        p
    }

    /// Decides for the record at `offset`. While the previous lease is unknown every record is
    /// checked and no lease is written: a new one must never be smaller than the old.
    fn admit(&self, p: &Partition, offset: i64, replayed: bool) -> Admission {
        match p.previous {
            Some(previous) => Admission {
                check: replayed || offset < previous,
                extend_to: (offset >= p.lease_end).then(|| (offset + self.span).max(previous)),
            },
            None => Admission {
                check: true,
                extend_to: None,
            },
        }
    }
}

/// Read leases in the object store, one small object per group and partition.
pub struct ObjectStoreLeases {
    sink: Sink,
    group: String,
    table: Mutex<LeaseTable>,
}

impl ObjectStoreLeases {
    pub fn new(sink: Sink, group: String, span: i64) -> ObjectStoreLeases {
        ObjectStoreLeases {
            sink,
            group,
            table: Mutex::new(LeaseTable::new(span)),
        }
    }

    fn with<R>(&self, origin: &Origin, f: impl FnOnce(&LeaseTable, &mut Partition) -> R) -> R {
        let mut table = self.table.lock().expect("lease table");
        let mut p = *table.state(origin);
        let r = f(&table, &mut p);
        *table.state(origin) = p;
        r
    }

    async fn admit_now(&self, origin: &Origin, replayed: bool) -> bool {
        let tp = TopicPartition::of(origin);
        if self.with(origin, |_, p| p.previous.is_none() && p.may_try()) {
            let read = tokio::time::timeout(LEASE_TIMEOUT, self.sink.lease(&self.group, &tp.topic, tp.partition)).await;
            self.with(origin, |_, p| match read {
                Ok(Ok(previous)) => {
                    p.previous = Some(previous.unwrap_or(0));
                    p.failed_at = None;
                }
                other => {
                    tracing::warn!(partition = tp.partition, error = ?other.map(|r| r.err()), "read lease unreadable; checking records for earlier results until it can be read");
                    p.failed_at = Some(Instant::now());
                }
            });
        }
        let (admission, may_try) = self.with(origin, |table, p| (table.admit(p, origin.offset, replayed), p.may_try()));
        let Some(end) = admission.extend_to else { return admission.check };
        if !may_try {
            return true;
        }
        let written = tokio::time::timeout(LEASE_TIMEOUT, self.sink.put_lease(&self.group, &tp.topic, tp.partition, end)).await;
        self.with(origin, |_, p| match written {
            Ok(Ok(())) => {
                p.lease_end = p.lease_end.max(end);
                p.failed_at = None;
                admission.check
            }
            other => {
                tracing::warn!(partition = tp.partition, end, error = ?other.map(|r| r.err()), "could not record the read lease; checking records until it can be");
                p.failed_at = Some(Instant::now());
                true
            }
        })
    }
}

impl RedeliveryCheck for ObjectStoreLeases {
    fn admit<'a>(&'a self, origin: &'a Origin, replayed: bool) -> BoxFuture<'a, bool> {
        Box::pin(self.admit_now(origin, replayed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin(offset: i64, generation: u64) -> Origin {
        Origin {
            topic: "t".into(),
            partition: 0,
            offset,
            generation,
        }
    }

    /// The table's decision for `offset`, then the lease recorded when it asked for one.
    fn admit(t: &mut LeaseTable, offset: i64, replayed: bool) -> Admission {
        let o = origin(offset, 1);
        let p = *t.state(&o);
        let a = t.admit(&p, offset, replayed);
        if let Some(end) = a.extend_to {
            t.state(&o).lease_end = end;
        }
        a
    }

    fn known(t: &mut LeaseTable, previous: i64) {
        t.state(&origin(0, 1)).previous = Some(previous);
    }

    #[test]
    fn records_below_the_previous_lease_are_checked_the_rest_are_not() {
        let mut t = LeaseTable::new(LEASE_SPAN);
        known(&mut t, 100);
        let a = admit(&mut t, 40, false);
        assert!(a.check);
        assert_eq!(a.extend_to, Some(40 + LEASE_SPAN), "extends past the record");
        assert!(admit(&mut t, 99, false).check);
        assert_eq!(
            admit(&mut t, 100, false),
            Admission {
                check: false,
                extend_to: None
            }
        );
        assert!(admit(&mut t, 100, true).check, "replayed records are always checked");
    }

    #[test]
    fn a_new_lease_never_ends_before_the_previous_one() {
        let mut t = LeaseTable::new(LEASE_SPAN);
        known(&mut t, 10 * LEASE_SPAN);
        assert_eq!(admit(&mut t, 3, false).extend_to, Some(10 * LEASE_SPAN));
    }

    #[test]
    fn the_lease_is_extended_before_a_record_beyond_it() {
        let mut t = LeaseTable::new(LEASE_SPAN);
        known(&mut t, 0);
        let first = admit(&mut t, 0, false);
        assert_eq!(
            first,
            Admission {
                check: false,
                extend_to: Some(LEASE_SPAN)
            }
        );
        assert_eq!(admit(&mut t, LEASE_SPAN - 1, false).extend_to, None);
        assert_eq!(admit(&mut t, LEASE_SPAN, false).extend_to, Some(2 * LEASE_SPAN));
    }

    #[test]
    fn an_unknown_lease_means_checking_everything_and_writing_nothing() {
        let mut t = LeaseTable::new(LEASE_SPAN);
        assert_eq!(
            admit(&mut t, 1_000_000, false),
            Admission {
                check: true,
                extend_to: None
            }
        );
    }

    #[test]
    fn a_new_assignment_starts_from_scratch() {
        let mut t = LeaseTable::new(LEASE_SPAN);
        known(&mut t, 50);
        admit(&mut t, 60, false);
        let again = *t.state(&origin(70, 2));
        assert_eq!(
            (again.previous, again.lease_end),
            (None, 0),
            "read the lease again after a reassignment"
        );
    }

    #[tokio::test]
    async fn leases_live_in_the_store_and_a_later_owner_checks_below_them() {
        let dir = std::env::temp_dir().join(format!("sluice-leases-{}", uuid::Uuid::new_v4()));
        let sink = Sink::from_url(&format!("file://{}", dir.display())).unwrap();
        let first = ObjectStoreLeases::new(sink.clone(), "g".into(), 10);
        assert!(!first.admit(&origin(0, 1), false).await, "nothing stored: new records run at once");
        assert!(!first.admit(&origin(5, 1), false).await);
        assert_eq!(
            sink.lease("g", "t", 0).await.unwrap(),
            Some(10),
            "recorded before the record started"
        );
        // A second owner (another process) finds the lease.
        let second = ObjectStoreLeases::new(sink.clone(), "g".into(), 10);
        assert!(second.admit(&origin(6, 1), false).await, "may have been started before");
        assert_eq!(sink.lease("g", "t", 0).await.unwrap(), Some(16), "extended past the record");
        assert!(!second.admit(&origin(10, 1), false).await, "beyond the old lease: new");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
