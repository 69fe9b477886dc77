//! Cancels from the control topic (`sluice.control.v1`). Every worker reads the whole topic —
//! every partition, from the beginning, outside any consumer group — on a thread of its own, so
//! whichever worker holds a task learns of its cancel. The set is bounded: a cancel is kept for
//! [`KEEP`] (longer than any task waits) and at most [`MAX`] of them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::Message;
use sluice_schemas::{ControlAction, ControlRecord};
use sluice_service::kafka::WholeTopics;
use uuid::Uuid;

/// How long a cancel is remembered, from the moment the client asked (the record's `at`).
const KEEP: Duration = Duration::from_secs(24 * 3600);
/// Most cancels remembered; the oldest go first.
const MAX: usize = 200_000;

/// The cancels, by task id and by when each is forgotten (so eviction is a pop, O(log n)).
#[derive(Default)]
struct Set {
    by_id: HashMap<Uuid, DateTime<Utc>>,
    by_expiry: BTreeSet<(DateTime<Utc>, Uuid)>,
}

/// The cancelled task ids this worker knows of.
#[derive(Clone)]
pub(crate) struct Cancellations {
    set: Arc<Mutex<Set>>,
    max: usize,
}

impl Default for Cancellations {
    fn default() -> Self {
        Cancellations::with_max(MAX)
    }
}

impl Cancellations {
    fn with_max(max: usize) -> Cancellations {
        Cancellations {
            set: Arc::default(),
            max: max.max(1),
        }
    }

    pub(crate) fn contains(&self, id: &Uuid) -> bool {
        let set = self.set.lock().expect("not poisoned");
        set.by_id.get(id).is_some_and(|expiry| *expiry > Utc::now())
    }

    /// Remembers the cancel of `id` asked for at `at` (the record's own time, so a worker that
    /// reads the topic again after a restart forgets each cancel when the first one did).
    pub(crate) fn insert(&self, id: Uuid, at: DateTime<Utc>) {
        let now = Utc::now();
        let expiry = at + chrono::Duration::from_std(KEEP).expect("KEEP fits");
        let mut set = self.set.lock().expect("not poisoned");
        if expiry > now {
            if let Some(old) = set.by_id.insert(id, expiry) {
                set.by_expiry.remove(&(old, id));
            }
            set.by_expiry.insert((expiry, id));
        }
        while let Some(&(first, first_id)) = set.by_expiry.first() {
            if first > now && set.by_id.len() <= self.max {
                break;
            }
            set.by_expiry.pop_first();
            set.by_id.remove(&first_id);
        }
    }

    /// Reads `topic` whole on a thread of its own until the process exits.
    pub(crate) fn follow(&self, consumer: BaseConsumer, topic: String) -> std::io::Result<()> {
        let this = self.clone();
        std::thread::Builder::new().name("control".into()).spawn(move || {
            let mut whole = WholeTopics::new(vec![topic]);
            let mut last_metadata = Instant::now() - Duration::from_secs(60);
            loop {
                if last_metadata.elapsed() >= Duration::from_secs(5) {
                    last_metadata = Instant::now();
                    if let Err(e) = whole.refresh(&consumer) {
                        tracing::warn!(error = %e, "control topic: assigning partitions failed");
                    }
                }
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(m)) => {
                        let record = m.payload().and_then(|p| serde_json::from_slice::<ControlRecord>(p).ok());
                        match record {
                            Some(r) if r.action == ControlAction::Cancel => {
                                tracing::info!(task_id = %r.task_id, tenant = %r.tenant, "cancel received");
                                this.insert(r.task_id, r.at);
                            }
                            Some(_) => {}
                            None => tracing::warn!(offset = m.offset(), "control topic: unreadable record skipped"),
                        }
                    }
                    Some(Err(e)) => tracing::debug!(error = %e, "control topic: poll"),
                    None => {}
                }
            }
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ago(hours: i64) -> DateTime<Utc> {
        Utc::now() - chrono::Duration::hours(hours)
    }

    #[test]
    fn remembers_cancels_within_its_bound_oldest_first() {
        let c = Cancellations::with_max(100);
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        c.insert(ids[0], ago(2));
        c.insert(ids[1], ago(1));
        assert!(c.contains(&ids[0]) && c.contains(&ids[1]));
        assert!(!c.contains(&ids[2]));
        for _ in 0..99 {
            c.insert(Uuid::new_v4(), Utc::now());
        }
        let set = c.set.lock().unwrap();
        assert_eq!((set.by_id.len(), set.by_expiry.len()), (100, 100));
        drop(set);
        assert!(!c.contains(&ids[0]), "the oldest cancel goes first");
        assert!(c.contains(&ids[1]));
    }

    #[test]
    fn a_cancel_is_forgotten_by_its_own_time_not_by_when_it_was_read() {
        let c = Cancellations::with_max(100);
        let (stale, recent) = (Uuid::now_v7(), Uuid::now_v7());
        // As a restarted worker reads them back: a cancel asked 25 h ago is already past.
        c.insert(stale, ago(25));
        c.insert(recent, ago(23));
        assert!(!c.contains(&stale));
        assert!(c.contains(&recent));
        assert_eq!(c.set.lock().unwrap().by_id.len(), 1);
    }
}
