//! Task ids being worked on in this worker. Two records of one task id (a submission repeated
//! with its `Idempotency-Key` through two producer replicas, a replay) share a partition, so they
//! meet here: the later one waits until the earlier one is finished, then looks for its results
//! and is announced from them instead of running again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;
use uuid::Uuid;

/// The ids in flight, each with a semaphore closed when its record is finished.
#[derive(Debug, Default)]
pub(crate) struct Running {
    ids: Mutex<HashMap<Uuid, Arc<Semaphore>>>,
}

/// A record's hold on its task id, released when dropped (with its job, after its outcome).
#[derive(Debug)]
pub(crate) struct Claim {
    running: Arc<Running>,
    id: Uuid,
    done: Arc<Semaphore>,
}

impl Running {
    /// Claims `id`; when another record holds it, returns what closes when that one is done.
    pub(crate) fn claim(self: &Arc<Self>, id: Uuid) -> Result<Claim, Arc<Semaphore>> {
        let mut ids = self.ids.lock().expect("running ids");
        if let Some(first) = ids.get(&id) {
            return Err(first.clone());
        }
        let done = Arc::new(Semaphore::new(0));
        ids.insert(id, done.clone());
        Ok(Claim {
            running: self.clone(),
            id,
            done,
        })
    }

    /// Claims `id`, waiting while another record holds it.
    pub(crate) async fn claim_after_others(self: &Arc<Self>, id: Uuid) -> Claim {
        loop {
            match self.claim(id) {
                Ok(claim) => return claim,
                Err(first) => {
                    let _ = first.acquire().await; // closed: the first is done
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
        if ids.get(&self.id).is_some_and(|d| Arc::ptr_eq(d, &self.done)) {
            ids.remove(&self.id);
        }
        self.done.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_record_of_a_task_waits_for_the_first() {
        let running = Arc::new(Running::default());
        let id = Uuid::now_v7();
        let first = running.claim(id).unwrap();
        let waiter = {
            let running = running.clone();
            tokio::spawn(async move { running.claim_after_others(id).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "held while the first runs");
        assert!(running.claim(Uuid::now_v7()).is_ok(), "other ids are not held up");
        drop(first);
        let second = waiter.await.unwrap();
        assert_eq!(running.len(), 1);
        drop(second);
        assert_eq!(running.len(), 0);
    }
}
