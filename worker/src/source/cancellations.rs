//! Cancels from the control topic (`sluice.control.v1`). Every worker reads the whole topic —
//! every partition, from the beginning, outside any consumer group — on a thread of its own, so
//! whichever worker holds a task learns of its cancel. A starting worker reads the topic to the
//! end it had at start before it joins the group (bounded by [`CATCH_UP`]), so a task cancelled
//! while queued never runs on a worker that started after the cancel.
//!
//! The set is bounded. A cancel is kept for as long as a task may wait: the longest deadline the
//! catalog allows (`max_ttl_seconds`, 30 days by default), at least a day. Each tenant keeps at
//! most [`MAX_PER_TENANT`], its oldest going first, and past [`MAX`] in all the tenant holding
//! the most loses its oldest: one tenant's cancels never evict another's within its share.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::Message;
use sluice_schemas::{ControlAction, ControlRecord};
use sluice_service::kafka::WholeTopics;
use uuid::Uuid;

/// The shortest time a cancel is remembered, from the moment the client asked (the record's
/// `at`).
const MIN_KEEP: Duration = Duration::from_secs(24 * 3600);
/// Most cancels remembered per tenant.
const MAX_PER_TENANT: usize = 50_000;
/// Most cancels remembered in all.
const MAX: usize = 200_000;
/// The longest a starting worker waits to have read the control topic before it runs tasks.
pub(crate) const CATCH_UP: Duration = Duration::from_secs(30);

type Entry = (DateTime<Utc>, Uuid);

/// The cancels, by task id, by when each is forgotten (so eviction is a pop, O(log n)), and
/// per tenant.
#[derive(Default)]
struct Set {
    by_id: HashMap<Uuid, (DateTime<Utc>, Arc<str>)>,
    by_expiry: BTreeSet<Entry>,
    by_tenant: HashMap<Arc<str>, BTreeSet<Entry>>,
}

impl Set {
    fn remove(&mut self, id: Uuid) {
        if let Some((expiry, tenant)) = self.by_id.remove(&id) {
            self.by_expiry.remove(&(expiry, id));
            if let Some(of) = self.by_tenant.get_mut(&tenant) {
                of.remove(&(expiry, id));
                if of.is_empty() {
                    self.by_tenant.remove(&tenant);
                }
            }
        }
    }

    /// The oldest cancel of `tenant`.
    fn oldest_of(&self, tenant: &str) -> Option<Uuid> {
        self.by_tenant.get(tenant)?.first().map(|(_, id)| *id)
    }
}

/// The cancelled task ids this worker knows of.
#[derive(Clone)]
pub(crate) struct Cancellations {
    set: Arc<Mutex<Set>>,
    keep: Duration,
    max_per_tenant: usize,
    max: usize,
    /// True once the topic was read to the end it had when reading began.
    caught_up: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for Cancellations {
    fn default() -> Self {
        Cancellations::new(MIN_KEEP)
    }
}

impl Cancellations {
    /// Cancels kept for `keep` (at least a day).
    pub(crate) fn new(keep: Duration) -> Cancellations {
        Cancellations::with_bounds(keep, MAX_PER_TENANT, MAX)
    }

    fn with_bounds(keep: Duration, max_per_tenant: usize, max: usize) -> Cancellations {
        Cancellations {
            set: Arc::default(),
            keep: keep.max(MIN_KEEP),
            max_per_tenant: max_per_tenant.max(1),
            max: max.max(1),
            caught_up: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    pub(crate) fn contains(&self, id: &Uuid) -> bool {
        let set = self.set.lock().expect("not poisoned");
        set.by_id.get(id).is_some_and(|(expiry, _)| *expiry > Utc::now())
    }

    /// Remembers `tenant`'s cancel of `id` asked for at `at` (the record's own time, so a worker
    /// that reads the topic again after a restart forgets each cancel when the first one did).
    pub(crate) fn insert(&self, id: Uuid, tenant: &str, at: DateTime<Utc>) {
        let now = Utc::now();
        let expiry = at + chrono::Duration::from_std(self.keep).unwrap_or(chrono::Duration::MAX);
        let mut set = self.set.lock().expect("not poisoned");
        if expiry > now {
            set.remove(id);
            let tenant: Arc<str> = tenant.into();
            set.by_id.insert(id, (expiry, tenant.clone()));
            set.by_expiry.insert((expiry, id));
            set.by_tenant.entry(tenant.clone()).or_default().insert((expiry, id));
            if set.by_tenant[&tenant].len() > self.max_per_tenant
                && let Some(oldest) = set.oldest_of(&tenant)
            {
                set.remove(oldest);
            }
        }
        while let Some(&(first, first_id)) = set.by_expiry.first()
            && first <= now
        {
            set.remove(first_id);
        }
        while set.by_id.len() > self.max {
            let largest = set.by_tenant.iter().max_by_key(|(_, of)| of.len()).map(|(t, _)| t.clone());
            match largest.and_then(|t| set.oldest_of(&t)) {
                Some(oldest) => set.remove(oldest),
                None => break,
            }
        }
    }

    /// Waits until the topic was read to the end it had when reading began, or `timeout`
    /// passed; whether it was.
    pub(crate) async fn caught_up(&self, timeout: Duration) -> bool {
        let mut caught_up = self.caught_up.subscribe();
        matches!(tokio::time::timeout(timeout, caught_up.wait_for(|done| *done)).await, Ok(Ok(_)))
    }

    /// Reads `topic` whole on a thread of its own until the process exits.
    pub(crate) fn follow(&self, consumer: BaseConsumer, topic: String) -> std::io::Result<()> {
        let this = self.clone();
        std::thread::Builder::new().name("control".into()).spawn(move || {
            let mut whole = WholeTopics::new(vec![topic]);
            let mut last_metadata = Instant::now() - Duration::from_secs(60);
            let mut ends: Option<Vec<(String, i32, i64)>> = None;
            loop {
                if last_metadata.elapsed() >= Duration::from_secs(5)
                    || (ends.is_none() && last_metadata.elapsed() >= Duration::from_millis(500))
                {
                    last_metadata = Instant::now();
                    if let Err(e) = whole.refresh(&consumer) {
                        tracing::warn!(error = %e, "control topic: assigning partitions failed");
                    } else if ends.is_none() && !whole.partitions().is_empty() {
                        ends = whole.ends(&consumer).ok();
                    }
                }
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(m)) => {
                        let record = m.payload().and_then(|p| serde_json::from_slice::<ControlRecord>(p).ok());
                        match record {
                            Some(r) if r.action == ControlAction::Cancel => {
                                tracing::info!(task_id = %r.task_id, tenant = %r.tenant, "cancel received");
                                this.insert(r.task_id, &r.tenant, r.at);
                            }
                            Some(_) => {}
                            None => tracing::warn!(offset = m.offset(), "control topic: unreadable record skipped"),
                        }
                    }
                    Some(Err(e)) => tracing::debug!(error = %e, "control topic: poll"),
                    None => {}
                }
                if !*this.caught_up.borrow()
                    && let Some(ends) = &ends
                    && WholeTopics::reached(&consumer, ends, |_, _| None)
                {
                    tracing::info!("control topic read to its end: cancels known");
                    this.caught_up.send_replace(true);
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
        let c = Cancellations::with_bounds(MIN_KEEP, 1_000, 100);
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        c.insert(ids[0], "a", ago(2));
        c.insert(ids[1], "a", ago(1));
        assert!(c.contains(&ids[0]) && c.contains(&ids[1]));
        assert!(!c.contains(&ids[2]));
        for _ in 0..99 {
            c.insert(Uuid::new_v4(), "a", Utc::now());
        }
        let set = c.set.lock().unwrap();
        assert_eq!((set.by_id.len(), set.by_expiry.len(), set.by_tenant["a"].len()), (100, 100, 100));
        drop(set);
        assert!(!c.contains(&ids[0]), "the oldest cancel goes first");
        assert!(c.contains(&ids[1]));
    }

    #[test]
    fn one_tenants_flood_of_cancels_evicts_only_its_own() {
        let c = Cancellations::with_bounds(MIN_KEEP, 50, 80);
        let theirs: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
        for id in &theirs {
            c.insert(*id, "quiet", ago(3));
        }
        for _ in 0..1_000 {
            c.insert(Uuid::new_v4(), "noisy", Utc::now());
        }
        assert!(theirs.iter().all(|id| c.contains(id)), "older, but another tenant's");
        let set = c.set.lock().unwrap();
        assert_eq!(set.by_tenant["noisy"].len(), 50, "its own bound");
        assert_eq!(set.by_id.len(), 80);
    }

    #[test]
    fn a_cancel_is_kept_as_long_as_the_catalog_lets_a_task_wait() {
        let c = Cancellations::new(Duration::from_secs(30 * 24 * 3600));
        let (month_old, older) = (Uuid::now_v7(), Uuid::now_v7());
        c.insert(month_old, "a", ago(29 * 24));
        c.insert(older, "a", ago(31 * 24));
        assert!(c.contains(&month_old) && !c.contains(&older));
        assert_eq!(Cancellations::new(Duration::from_secs(60)).keep, MIN_KEEP, "at least a day");
    }

    #[test]
    fn a_cancel_is_forgotten_by_its_own_time_not_by_when_it_was_read() {
        let c = Cancellations::default();
        let (stale, recent) = (Uuid::now_v7(), Uuid::now_v7());
        // As a restarted worker reads them back: a cancel asked 25 h ago is already past.
        c.insert(stale, "a", ago(25));
        c.insert(recent, "a", ago(23));
        assert!(!c.contains(&stale));
        assert!(c.contains(&recent));
        assert_eq!(c.set.lock().unwrap().by_id.len(), 1);
    }
}
