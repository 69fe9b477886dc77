//! Cancels from the control topic (`sluice.control.v1`). Every worker reads the whole topic —
//! every partition, from the beginning, outside any consumer group — on a thread of its own, so
//! whichever worker holds a task learns of its cancel. The set is bounded: a cancel is kept for
//! [`KEEP`] (longer than any task waits) and at most [`MAX`] of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::BaseConsumer;
use rdkafka::message::Message;
use sluice_schemas::{ControlAction, ControlRecord};
use sluice_service::kafka::WholeTopics;
use uuid::Uuid;

/// How long a cancel is remembered.
const KEEP: Duration = Duration::from_secs(24 * 3600);
/// Most cancels remembered; the oldest go first.
const MAX: usize = 200_000;

/// The cancelled task ids this worker knows of.
#[derive(Clone)]
pub(crate) struct Cancellations {
    ids: Arc<Mutex<HashMap<Uuid, Instant>>>,
    max: usize,
}

impl Default for Cancellations {
    fn default() -> Self {
        Cancellations::with_max(MAX)
    }
}

impl Cancellations {
    fn with_max(max: usize) -> Cancellations {
        Cancellations { ids: Arc::default(), max }
    }

    pub(crate) fn contains(&self, id: &Uuid) -> bool {
        self.ids.lock().expect("not poisoned").contains_key(id)
    }

    pub(crate) fn insert(&self, id: Uuid) {
        let mut ids = self.ids.lock().expect("not poisoned");
        if ids.len() >= self.max {
            let now = Instant::now();
            ids.retain(|_, at| now.duration_since(*at) < KEEP);
            if ids.len() >= self.max {
                let oldest = ids.iter().min_by_key(|(_, at)| **at).map(|(id, _)| *id);
                if let Some(oldest) = oldest {
                    ids.remove(&oldest);
                }
            }
        }
        ids.insert(id, Instant::now());
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
                                this.insert(r.task_id);
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

    #[test]
    fn remembers_cancels_within_its_bound() {
        let c = Cancellations::with_max(100);
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        c.insert(ids[0]);
        assert!(c.contains(&ids[0]));
        assert!(!c.contains(&ids[1]));
        for _ in 0..100 {
            c.insert(Uuid::new_v4());
        }
        assert!(c.ids.lock().unwrap().len() <= 100);
        assert!(!c.contains(&ids[0]), "the oldest goes first");
    }
}
