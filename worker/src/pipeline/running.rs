//! Task ids being worked on in this worker. Two records of one task id (a submission repeated
//! with its `Idempotency-Key` through two producer replicas, a replay) share a partition, so they
//! meet here: the later one waits until the earlier one is finished, then looks for its results
//! and is announced from them instead of running again. A hold from an assignment that is over
//! (the partition was revoked, and perhaps assigned back) blocks nothing: its job may linger
//! (retrying storage, or never to be acknowledged), and the new assignment's record must not
//! wait on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::source::record::Origin;

/// How often a waiting record looks again whether the hold it waits on is still current.
const RECHECK: Duration = Duration::from_millis(500);

/// The ids in flight, each with a semaphore closed when its record is finished.
#[derive(Debug, Default)]
pub(crate) struct Running {
    ids: Mutex<HashMap<Uuid, (Arc<Semaphore>, Origin)>>,
}

/// A record's hold on its task id, released when dropped (with its job, after its outcome).
#[derive(Debug)]
pub(crate) struct Claim {
    running: Arc<Running>,
    id: Uuid,
    done: Arc<Semaphore>,
}

impl Running {
    /// Claims `id` for the record at `origin`; when another record of a current assignment
    /// (`current`) holds it, returns what closes when that one is done.
    pub(crate) fn claim(self: &Arc<Self>, id: Uuid, origin: &Origin, current: impl Fn(&Origin) -> bool) -> Result<Claim, Arc<Semaphore>> {
        let mut ids = self.ids.lock().expect("running ids");
        if let Some((first, holder)) = ids.get(&id)
            && current(holder)
        {
            return Err(first.clone());
        }
        let done = Arc::new(Semaphore::new(0));
        ids.insert(id, (done.clone(), origin.clone()));
        Ok(Claim {
            running: self.clone(),
            id,
            done,
        })
    }

    /// Claims `id`, waiting while another record of a current assignment holds it.
    pub(crate) async fn claim_after_others(self: &Arc<Self>, id: Uuid, origin: &Origin, current: impl Fn(&Origin) -> bool) -> Claim {
        loop {
            match self.claim(id, origin, &current) {
                Ok(claim) => return claim,
                Err(first) => {
                    // Closed: the first is done; or look again whether it is still current.
                    let _ = tokio::time::timeout(RECHECK, first.acquire()).await;
                }
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.ids.lock().expect("running ids").len()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut ids = self.running.ids.lock().expect("running ids");
        if ids.get(&self.id).is_some_and(|(d, _)| Arc::ptr_eq(d, &self.done)) {
            ids.remove(&self.id);
        }
        self.done.close();
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

    #[tokio::test]
    async fn a_second_record_of_a_task_waits_for_the_first() {
        let running = Arc::new(Running::default());
        let id = Uuid::now_v7();
        let all_current = |_: &Origin| true;
        let first = running.claim(id, &origin(1, 1), all_current).unwrap();
        let waiter = {
            let running = running.clone();
            tokio::spawn(async move { running.claim_after_others(id, &origin(2, 1), all_current).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "held while the first runs");
        assert!(
            running.claim(Uuid::now_v7(), &origin(3, 1), all_current).is_ok(),
            "other ids are not held up"
        );
        drop(first);
        let second = waiter.await.unwrap();
        assert_eq!(running.len(), 1);
        drop(second);
        assert_eq!(running.len(), 0);
    }

    #[tokio::test]
    async fn a_hold_from_an_assignment_that_is_over_blocks_nothing() {
        let running = Arc::new(Running::default());
        let id = Uuid::now_v7();
        let generation_2 = |o: &Origin| o.generation == 2;
        // Held under generation 1, which lingers after the partition was assigned again.
        let stale = running.claim(id, &origin(5, 1), |_| true).unwrap();
        let fresh = tokio::time::timeout(Duration::from_secs(2), running.claim_after_others(id, &origin(5, 2), generation_2))
            .await
            .expect("not blocked by the stale hold");
        drop(stale); // the stale job ends later: the fresh hold stays
        assert!(running.claim(id, &origin(6, 2), generation_2).is_err());
        drop(fresh);
        assert_eq!(running.len(), 0);
    }
}
