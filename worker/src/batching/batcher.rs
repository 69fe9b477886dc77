//! Shape-bucketed dynamic batching. Tasks batch together only when the model can run them in
//! one call with the same memory per task (same [`Bucket`]). The engine stage pulls: when it is
//! ready for more work it asks for a batch, and gets the bucket whose oldest task has waited
//! longest — as soon as that bucket holds its learned ceiling of tasks, or once its oldest task
//! has waited `max_wait`. Under load batches are full; when idle a task waits at most `max_wait`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::models::Bucket;

/// How many tasks of a bucket may go in one batch (the adaptive layer's learned ceiling).
pub trait BatchLimits: Send + Sync {
    fn limit(&self, bucket: &Bucket) -> usize;
}

/// A batch of one bucket.
#[derive(Debug)]
pub struct Batch<T> {
    pub bucket: Bucket,
    pub items: Vec<T>,
}

/// Asks the batcher for the next batch.
#[derive(Clone)]
pub struct BatchRequests<T> {
    tx: mpsc::Sender<oneshot::Sender<Batch<T>>>,
}

impl<T> BatchRequests<T> {
    /// The next batch, or `None` once the input is closed and every queued task was handed out.
    pub async fn next(&self) -> Option<Batch<T>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(reply).await.ok()?;
        rx.await.ok()
    }
}

struct Queued<T> {
    item: T,
    since: Instant,
}

/// The batcher actor: receives `(bucket, item)` and serves batch requests.
pub struct Batcher<T> {
    input: mpsc::Receiver<(Bucket, T)>,
    requests: mpsc::Receiver<oneshot::Sender<Batch<T>>>,
    queues: BTreeMap<Bucket, VecDeque<Queued<T>>>,
    waiting: VecDeque<oneshot::Sender<Batch<T>>>,
    limits: Arc<dyn BatchLimits>,
    max_wait: Duration,
    closed: bool,
}

impl<T: Send + 'static> Batcher<T> {
    pub fn new(input: mpsc::Receiver<(Bucket, T)>, limits: Arc<dyn BatchLimits>, max_wait: Duration) -> (Batcher<T>, BatchRequests<T>) {
        let (tx, requests) = mpsc::channel(16);
        let batcher = Batcher {
            input,
            requests,
            queues: BTreeMap::new(),
            waiting: VecDeque::new(),
            limits,
            max_wait,
            closed: false,
        };
        (batcher, BatchRequests { tx })
    }

    /// The bucket to serve next and whether it is ready: full, timed out, or the input closed.
    fn next_ready(&self, now: Instant) -> Option<(Bucket, usize)> {
        let (bucket, queue) = self
            .queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .min_by_key(|(_, q)| q.front().expect("non-empty").since)?;
        let limit = self.limits.limit(bucket);
        let oldest = queue.front().expect("non-empty").since;
        let any_full = self.queues.iter().any(|(b, q)| q.len() >= self.limits.limit(b));
        if queue.len() >= limit || now >= oldest + self.max_wait || self.closed {
            return Some((bucket.clone(), limit));
        }
        if any_full {
            // The oldest bucket is not ready but another is full: serve the full one first.
            let (bucket, _) = self.queues.iter().find(|(b, q)| q.len() >= self.limits.limit(b))?;
            return Some((bucket.clone(), self.limits.limit(bucket)));
        }
        None
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.queues
            .values()
            .filter_map(|q| q.front())
            .map(|q| q.since + self.max_wait)
            .min()
    }

    fn serve(&mut self) {
        let now = Instant::now();
        while !self.waiting.is_empty() {
            let Some((bucket, limit)) = self.next_ready(now) else { break };
            let queue = self.queues.get_mut(&bucket).expect("bucket queued");
            let n = limit.min(queue.len());
            let items: Vec<T> = queue.drain(..n).map(|q| q.item).collect();
            if queue.is_empty() {
                self.queues.remove(&bucket);
            }
            let reply = self.waiting.pop_front().expect("a waiting request");
            if let Err(batch) = reply.send(Batch {
                bucket: bucket.clone(),
                items,
            }) {
                // The requester went away; keep its tasks at the front.
                let queue = self.queues.entry(bucket).or_default();
                for item in batch.items.into_iter().rev() {
                    queue.push_front(Queued { item, since: now });
                }
            }
        }
    }

    /// Runs until the input is closed and everything queued was handed out. Requests still
    /// waiting then get `None` (their sender is dropped).
    pub async fn run(mut self) {
        loop {
            self.serve();
            if self.closed && self.queues.is_empty() {
                return;
            }
            // A deadline only matters to a waiting request: with none waiting, a passed deadline
            // would wake this loop forever.
            let deadline = if self.waiting.is_empty() { None } else { self.next_deadline() };
            tokio::select! {
                item = self.input.recv(), if !self.closed => match item {
                    Some((bucket, item)) => self.queues.entry(bucket).or_default().push_back(Queued { item, since: Instant::now() }),
                    None => self.closed = true,
                },
                request = self.requests.recv() => match request {
                    Some(reply) => self.waiting.push_back(reply),
                    None => return,
                },
                _ = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::CallKey;

    fn bucket(rows: usize) -> Bucket {
        Bucket {
            key: CallKey::none(),
            model: "m".into(),
            rows_per_task: rows,
            alone: None,
        }
    }

    struct Fixed(usize);
    impl BatchLimits for Fixed {
        fn limit(&self, _: &Bucket) -> usize {
            self.0
        }
    }

    #[tokio::test(start_paused = true)]
    async fn full_buckets_go_at_once_partial_ones_after_max_wait() {
        let (tx, rx) = mpsc::channel(64);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(3)), Duration::from_millis(50));
        tokio::spawn(batcher.run());
        for i in 0..4 {
            tx.send((bucket(1), i)).await.unwrap();
        }
        tx.send((bucket(2), 100)).await.unwrap();
        let started = Instant::now();
        let first = requests.next().await.unwrap();
        assert_eq!((first.bucket.rows_per_task, first.items.clone()), (1, vec![0, 1, 2]));
        assert!(started.elapsed() < Duration::from_millis(50), "a full batch does not wait");
        // Bucket 1's remaining task is older than bucket 2's: it goes first, after max_wait.
        let second = requests.next().await.unwrap();
        assert_eq!(second.items, vec![3]);
        assert!(started.elapsed() >= Duration::from_millis(50));
        let third = requests.next().await.unwrap();
        assert_eq!(third.items, vec![100]);
        drop(tx);
        assert!(requests.next().await.is_none());
    }

    #[tokio::test]
    async fn idles_without_spinning_when_nobody_asks() {
        let (tx, rx) = mpsc::channel(8);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(4)), Duration::from_millis(1));
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = polls.clone();
        // Count how often the batcher's future is polled while a partial bucket is past its deadline
        // and no request waits: it should sleep, not spin.
        let run = tokio::spawn(async move {
            let mut fut = std::pin::pin!(batcher.run());
            std::future::poll_fn(|cx| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                fut.as_mut().poll(cx)
            })
            .await
        });
        tx.send((bucket(1), 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            polls.load(std::sync::atomic::Ordering::Relaxed) < 20,
            "polled {} times while idle",
            polls.load(std::sync::atomic::Ordering::Relaxed)
        );
        assert_eq!(requests.next().await.unwrap().items, vec![1]);
        drop(tx);
        drop(requests);
        run.await.unwrap();
    }
}
