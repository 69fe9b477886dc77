//! The crash guard's log: where the records in a model call are written before the call starts
//! ([`crate::source::crash_guard`]). It is the commit metadata of a sibling consumer group,
//! `<group>.starts`, that no member ever joins: each partition's entry holds its whole started
//! set, and a new owner reads it with the task group's lease.
//!
//! Why not the task group's own commits: a start must be durable before its call, and in
//! exactly-once mode those commits are transactions. A plain commit there could only be written
//! between two transactions (one that overtook a transaction's offsets would move the position
//! back), so every model call waited for the transaction in flight, and fast tasks behind it
//! waited for the next: the exactly-once latency of a fast task was a multiple of at-least-once's
//! (README, delivery). Here a start is one plain commit of its own, whatever the task group is
//! doing, and the task group's position never moves for it.
//!
//! Writes are one at a time, each with every changed partition's whole set taken under the
//! log's lock, so the last one acknowledged is the newest. What the log gives up is fencing: the
//! task group's generation rejects a commit from a member that lost the partition, this group has
//! none. A worker that lost a partition without knowing it yet can write that partition's set
//! once more, until the new owner's next write replaces it: at worst a crash counted once too
//! often or too rarely, never a record lost or run twice.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::source::offsets::{Offsets, Starts, TopicPartition};

/// The log's consumer group, beside the workers' own.
pub(crate) fn group_of(task_group: &str) -> String {
    format!("{task_group}.starts")
}

/// How soon a failed write is tried again (with whatever changed since).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The log of one worker: a consumer of the sibling group that only commits and reads commits.
pub(crate) struct StartsLog {
    consumer: BaseConsumer,
    /// One write at a time, its sets taken under the lock.
    lock: Mutex<()>,
}

impl StartsLog {
    pub(crate) fn new(consumer: BaseConsumer) -> StartsLog {
        StartsLog {
            consumer,
            lock: Mutex::new(()),
        }
    }

    /// Writes the started sets that changed since the last write. Blocks.
    pub(crate) fn record(&self, offsets: &Offsets) {
        let _one = self.lock.lock().expect("starts log");
        let starts = offsets.starts_to_record();
        self.write(offsets, &starts);
    }

    /// Writes `starts` (those of revoked partitions, taken from the tracker). Blocks.
    pub(crate) fn record_revoked(&self, offsets: &Offsets, starts: &[Starts]) {
        let _one = self.lock.lock().expect("starts log");
        self.write(offsets, starts);
    }

    fn write(&self, offsets: &Offsets, starts: &[Starts]) {
        if starts.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for s in starts {
            let mut e = tpl.add_partition(&s.tp.topic, s.tp.partition);
            if e.set_offset(Offset::Offset(s.position)).is_ok() {
                e.set_metadata(crate::source::crash_guard::starts_metadata(&s.started));
            }
        }
        match self.consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => offsets.starts_recorded_as(starts),
            Err(e) => tracing::warn!(error = %e, "writing model calls' starts to the crash guard's log failed; retrying"),
        }
        // Serves the client's events (errors, logs), which queue up in a consumer never polled;
        // it is assigned nothing, so no record comes back.
        let _ = self.consumer.poll(Duration::ZERO);
    }
}

/// A new owner reads the previous owners' started sets from the log.
impl crate::source::redelivery::CommittedMetadata for StartsLog {
    fn committed_metadata(&self, tp: &TopicPartition, timeout: Duration) -> Result<String, String> {
        crate::source::committed_metadata_of(&self.consumer, tp, timeout)
    }
}

/// Writes the started sets whenever they change (a call starts or ends) until `stop` fires, one
/// write at a time: changes made during a write go with the next.
pub(crate) async fn record_loop(log: Arc<StartsLog>, offsets: Arc<Offsets>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = offsets.starts_wanted.notified() => {}
            _ = tokio::time::sleep(RETRY_AFTER) => {}
            _ = stop.cancelled() => return,
        }
        let (log, offsets) = (log.clone(), offsets.clone());
        let write = tokio::task::spawn_blocking(move || log.record(&offsets));
        tokio::select! {
            _ = write => {}
            _ = stop.cancelled() => return,
        }
    }
}
