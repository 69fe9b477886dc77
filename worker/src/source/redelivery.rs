//! The redelivery check: which records may have been started by an earlier delivery, so that
//! their results may already exist and must be looked up (the result manifest) before they run.
//!
//! Checking every task's manifest would cost a storage round trip per task, yet only redelivered
//! records can have results. [`RedeliveryCheck`] decides per record; it is asked by the decode
//! stage, on the async runtime, never by the Kafka poll thread, so a slow broker or store never
//! stalls polling (nor costs the worker its group membership).
//!
//! [`CommitMetadataLeases`] keeps a *read lease* per partition in the metadata of the group's
//! offset commits: a consumer never starts a record at or beyond its partition's lease end
//! without first committing a larger one, and every commit carries the lease (the tracker in
//! [`crate::source::offsets`] writes it). So on a new assignment every record below the committed lease
//! end may have been started by an earlier owner and is checked, and every record at or beyond
//! it is new and runs at once. The lease is read from the broker (an offset fetch) on the
//! partition's first record, not in the rebalance callback, and nothing is read from storage.
//! Replayed and redriven records (header `sluice-origin`) are always checked.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::source::offsets::{LeaseState, Offsets, TopicPartition};
use crate::source::record::Origin;

/// Decides, per record, whether an earlier delivery may have started it.
pub trait RedeliveryCheck: Send + Sync {
    /// Whether the record at `origin` needs the idempotency check before it runs. Called before
    /// the record starts, in offset order per partition. `replayed`: the record was copied back
    /// by replay or redrive.
    fn admit<'a>(&'a self, origin: &'a Origin, replayed: bool) -> BoxFuture<'a, bool>;

    /// Learns what the previous owner of `origin`'s partition left, if not known yet. Called for
    /// every record before anything else, those that fail before they could start included:
    /// nothing of a partition is committed until that is known.
    fn know_partition<'a>(&'a self, origin: &'a Origin) -> BoxFuture<'a, ()> {
        let _ = origin;
        Box::pin(std::future::ready(()))
    }
}

/// Records a lease covers beyond the record that extended it.
pub const LEASE_SPAN: i64 = 4096;

/// The longest a lease read or write may take before the record is checked instead.
const LEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a partition's unreadable lease is read again while its records wait.
const LEASE_RETRY: Duration = Duration::from_millis(250);

/// How a lease end is written in a commit's metadata.
const METADATA_PREFIX: &str = "sluice-lease:";

/// The commit metadata that records lease end `end`.
pub(crate) fn lease_metadata(end: i64) -> String {
    format!("{METADATA_PREFIX}{end}")
}

/// The lease end in a commit's metadata; 0 when there is none (no commit yet, or one written by
/// another tool).
pub(crate) fn parse_lease_metadata(metadata: &str) -> i64 {
    metadata
        .strip_prefix(METADATA_PREFIX)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Reads the metadata committed with a partition's offset (blocking: an offset fetch).
pub(crate) trait CommittedMetadata: Send + Sync + 'static {
    fn committed_metadata(&self, tp: &TopicPartition, timeout: Duration) -> Result<String, String>;
}

/// Read leases in the consumer group's commit metadata.
pub struct CommitMetadataLeases {
    offsets: Arc<Offsets>,
    reader: Arc<dyn CommittedMetadata>,
    span: i64,
}

impl CommitMetadataLeases {
    pub(crate) fn new(offsets: Arc<Offsets>, reader: Arc<dyn CommittedMetadata>, span: i64) -> CommitMetadataLeases {
        CommitMetadataLeases {
            offsets,
            reader,
            span: span.max(1),
        }
    }

    /// Reads the previous owner's lease of `origin`'s partition into the tracker.
    async fn read_previous(&self, origin: &Origin) {
        let (reader, tp) = (self.reader.clone(), TopicPartition::of(origin));
        let read = tokio::task::spawn_blocking(move || reader.committed_metadata(&tp, LEASE_TIMEOUT)).await;
        match read {
            Ok(Ok(metadata)) => {
                self.offsets
                    .found_starts(origin, crate::source::crash_guard::parse_starts(&metadata));
                self.offsets.found_done(origin, crate::source::done_ahead::parse_done(&metadata));
                self.offsets.found_lease(origin, Ok(parse_lease_metadata(&metadata)));
            }
            other => {
                let error = match other {
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                    Ok(Ok(_)) => unreachable!(),
                };
                tracing::warn!(
                    partition = origin.partition,
                    error,
                    "read lease unreadable; the partition's records wait until it can be read"
                );
                self.offsets.found_lease(origin, Err(()));
            }
        }
    }

    async fn admit_now(&self, origin: &Origin, replayed: bool) -> bool {
        if self.offsets.lease(origin) == (LeaseState::Unknown { may_try: true }) {
            self.read_previous(origin).await;
        }
        let LeaseState::Known { lease, may_try } = self.offsets.lease(origin) else {
            return true; // unknown: check everything, and commit nothing that would overwrite it
        };
        let check = replayed || origin.offset < lease.previous;
        if origin.offset < lease.confirmed {
            return check;
        }
        if !may_try {
            return true; // the last extension failed a moment ago
        }
        if origin.offset >= lease.wanted {
            self.offsets.want_lease(origin, (origin.offset + self.span).max(lease.previous));
        }
        if self.offsets.lease_covers(origin, origin.offset, LEASE_TIMEOUT).await {
            return check;
        }
        tracing::warn!(
            partition = origin.partition,
            offset = origin.offset,
            "could not commit the read lease; checking records until it can be"
        );
        true
    }
}

impl RedeliveryCheck for CommitMetadataLeases {
    fn admit<'a>(&'a self, origin: &'a Origin, replayed: bool) -> BoxFuture<'a, bool> {
        Box::pin(self.admit_now(origin, replayed))
    }

    /// Reads until it is known, retrying a failed read every [`LEASE_RETRY`] (the coordinator
    /// moving, a broker restarting); ends early when the assignment does. Nothing of the
    /// partition runs before: a record finished ahead by the previous owner
    /// ([`crate::source::done_ahead`]) must be known as such before it could run again, and
    /// nothing of it can be committed before either.
    fn know_partition<'a>(&'a self, origin: &'a Origin) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            loop {
                match self.offsets.lease(origin) {
                    LeaseState::Unknown { may_try: true } => self.read_previous(origin).await,
                    LeaseState::Unknown { may_try: false } => tokio::time::sleep(LEASE_RETRY).await,
                    LeaseState::Known { .. } | LeaseState::Gone => return,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::source::offsets::Commit;

    fn tp() -> TopicPartition {
        TopicPartition {
            topic: "t".into(),
            partition: 0,
        }
    }

    /// The broker's side, in process: committed metadata per partition, and a committer that
    /// writes what the tracker asks for.
    #[derive(Default)]
    struct Broker {
        metadata: Mutex<HashMap<TopicPartition, String>>,
        reads: Mutex<usize>,
    }

    impl CommittedMetadata for Broker {
        fn committed_metadata(&self, tp: &TopicPartition, _: Duration) -> Result<String, String> {
            *self.reads.lock().unwrap() += 1;
            Ok(self.metadata.lock().unwrap().get(tp).cloned().unwrap_or_default())
        }
    }

    impl Broker {
        /// Commits whatever the tracker wants, as the commit loop would, until `stop`.
        fn commit(&self, offsets: &Offsets) -> Vec<Commit> {
            let commits = offsets.commit_candidates();
            for c in &commits {
                self.metadata.lock().unwrap().insert(c.tp.clone(), lease_metadata(c.lease_end));
            }
            offsets.committed(&commits);
            commits
        }
    }

    /// A worker: its tracker, its check, and a committer task serving lease extensions.
    fn worker(broker: &Arc<Broker>, span: i64) -> (Arc<Offsets>, CommitMetadataLeases, tokio::task::JoinHandle<()>) {
        let offsets = Arc::new(Offsets::new());
        offsets.assign(&[tp()]);
        let check = CommitMetadataLeases::new(offsets.clone(), broker.clone(), span);
        let committer = {
            let (offsets, broker) = (offsets.clone(), broker.clone());
            tokio::spawn(async move {
                loop {
                    offsets.commit_wanted.notified().await;
                    broker.commit(&offsets);
                }
            })
        };
        (offsets, check, committer)
    }

    async fn admit(offsets: &Offsets, check: &CommitMetadataLeases, offset: i64, replayed: bool) -> bool {
        let origin = offsets.track(&tp(), offset).expect("assigned");
        check.admit(&origin, replayed).await
    }

    #[test]
    fn metadata_round_trips_and_foreign_metadata_means_no_lease() {
        assert_eq!(parse_lease_metadata(&lease_metadata(4096)), 4096);
        assert_eq!(parse_lease_metadata(""), 0);
        assert_eq!(parse_lease_metadata("written by some other tool"), 0);
    }

    #[tokio::test]
    async fn leases_live_in_commit_metadata_and_a_later_owner_checks_below_them() {
        let broker = Arc::new(Broker::default());
        let (offsets, first, committer) = worker(&broker, 10);
        assert!(
            !admit(&offsets, &first, 0, false).await,
            "nothing committed: new records run at once"
        );
        assert!(!admit(&offsets, &first, 5, false).await);
        assert_eq!(
            broker.metadata.lock().unwrap()[&tp()],
            lease_metadata(10),
            "committed before the record started"
        );
        assert!(admit(&offsets, &first, 6, true).await, "replayed records are always checked");
        committer.abort();
        // A second owner (another process) finds the lease in the group's commits.
        let (offsets, second, committer) = worker(&broker, 10);
        assert!(admit(&offsets, &second, 6, false).await, "may have been started before");
        assert_eq!(
            broker.metadata.lock().unwrap()[&tp()],
            lease_metadata(10),
            "still covered by the old lease: nothing to write"
        );
        assert!(!admit(&offsets, &second, 10, false).await, "beyond the old lease: new");
        assert_eq!(
            broker.metadata.lock().unwrap()[&tp()],
            lease_metadata(20),
            "extended past the record"
        );
        assert_eq!(*broker.reads.lock().unwrap(), 2, "one offset fetch per assignment");
        committer.abort();
    }

    /// A partition whose records all fail before they start (malformed, say) is committed too:
    /// its previous lease is read for them, and kept in the commit.
    #[tokio::test]
    async fn a_partition_of_records_that_never_start_is_committed() {
        let broker = Arc::new(Broker::default());
        broker.metadata.lock().unwrap().insert(tp(), lease_metadata(50));
        let (offsets, check, committer) = worker(&broker, 10);
        for offset in 0..3 {
            let origin = offsets.track(&tp(), offset).expect("assigned");
            check.know_partition(&origin).await;
            offsets.ack(&origin);
        }
        let commits = broker.commit(&offsets);
        assert_eq!(commits.iter().map(|c| (c.offset, c.lease_end)).collect::<Vec<_>>(), [(3, 50)]);
        assert_eq!(*broker.reads.lock().unwrap(), 1);
        committer.abort();
    }

    /// A lease read that fails (the coordinator moving) is retried on its own schedule: the
    /// partition's records wait for it, and then what the previous owner left is known.
    #[tokio::test]
    async fn an_unreadable_lease_is_read_again_until_it_is_known() {
        struct Flaky {
            broker: Broker,
            failures: Mutex<u32>,
        }
        impl CommittedMetadata for Flaky {
            fn committed_metadata(&self, tp: &TopicPartition, timeout: Duration) -> Result<String, String> {
                let mut failures = self.failures.lock().unwrap();
                if *failures > 0 {
                    *failures -= 1;
                    return Err("coordinator not available".into());
                }
                self.broker.committed_metadata(tp, timeout)
            }
        }
        let flaky = Arc::new(Flaky {
            broker: Broker::default(),
            failures: Mutex::new(2),
        });
        flaky
            .broker
            .metadata
            .lock()
            .unwrap()
            .insert(tp(), format!("{} done:3", lease_metadata(50)));
        let offsets = Arc::new(Offsets::new());
        offsets.assign(&[tp()]);
        let check = CommitMetadataLeases::new(offsets.clone(), flaky.clone(), 10);
        let origin = offsets.track(&tp(), 3).unwrap();
        check.know_partition(&origin).await;
        assert!(matches!(offsets.lease(&origin), LeaseState::Known { lease, .. } if lease.previous == 50));
        assert!(offsets.announced_ahead(&origin), "and what it finished ahead is skipped");
        assert_eq!(*flaky.broker.reads.lock().unwrap(), 1, "read once it could be, after two failures");
    }

    #[tokio::test]
    async fn a_new_lease_never_ends_before_the_previous_one() {
        let broker = Arc::new(Broker::default());
        broker.metadata.lock().unwrap().insert(tp(), lease_metadata(1_000));
        let (offsets, check, committer) = worker(&broker, 10);
        assert!(admit(&offsets, &check, 3, false).await);
        assert_eq!(broker.metadata.lock().unwrap()[&tp()], lease_metadata(1_000));
        committer.abort();
    }

    #[tokio::test]
    async fn a_lease_that_cannot_be_committed_means_checking() {
        let broker = Arc::new(Broker::default());
        let offsets = Arc::new(Offsets::new());
        offsets.assign(&[tp()]);
        let check = CommitMetadataLeases::new(offsets.clone(), broker.clone(), 10);
        // No committer runs: the extension is never acknowledged.
        tokio::time::pause();
        assert!(admit(&offsets, &check, 0, false).await, "not covered by a committed lease: checked");
        assert!(admit(&offsets, &check, 1, false).await, "and the next one at once, without waiting");
    }
}
