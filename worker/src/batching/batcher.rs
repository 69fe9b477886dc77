//! Shape-bucketed dynamic batching. Tasks batch together only when the model can run them in
//! one call with the same memory per task (same [`Bucket`]) and are of one priority lane. The
//! engine stage pulls: when it is ready for more work it asks for a batch, and gets a queue that
//! is ready (it holds its learned ceiling of tasks, or its oldest task has waited `max_wait`):
//! the best lane first, then the one whose oldest task came first, none overtaken more than
//! [`turns::MAX_OVERTAKEN`] times. Under load batches are full; when idle a task waits at most
//! `max_wait`, and an interactive one not at all.
//!
//! Fair between buckets: a batch is out from when the engine stage takes it until its last call
//! ends ([`Out`]). Each lane and bucket may have [`Admission::steady`] batches out (the engine's
//! slots and one more being prepared), all of them together [`Admission::most`], so that a
//! short task of another bucket or lane reaches the device gate while a long bucket's batches
//! run, never after every queued batch of it. The gate takes calls by lane, then in order of asking,
//! and a batch asks again for each call (each part of a task cut in parts): between buckets
//! the engine takes turns call by call.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use sluice_schemas::Priority;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::fair::{Fair, TenantWeights};
use crate::engine::turns::{self, Waiter};
use crate::models::Bucket;

/// How many tasks of a bucket may go in one batch (the adaptive layer's learned ceiling), and
/// whether its batches take tasks that arrive while they run.
pub trait BatchLimits: Send + Sync {
    fn limit(&self, bucket: &Bucket) -> usize;
    /// Whether a batch of `bucket` in `lane` takes the tasks that arrive while it runs, at its
    /// step boundaries ([`Joins`]): from its handout, such tasks are kept for it.
    fn takes_joins(&self, _lane: Priority, _bucket: &Bucket) -> bool {
        false
    }
}

/// How many batches may be out at once.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Batches of one lane and bucket: the engine's slots, and one more prepared while they run.
    pub steady: usize,
    /// Batches in all.
    pub most: usize,
}

impl Admission {
    /// For an engine of `slots` threads: `slots + 1` of each lane and bucket, three times that
    /// in all.
    pub fn for_slots(slots: usize) -> Admission {
        let steady = slots.max(1) + 1;
        Admission { steady, most: 3 * steady }
    }
}

/// A batch of one bucket and lane.
#[derive(Debug)]
pub struct Batch<T> {
    pub bucket: Bucket,
    pub items: Vec<T>,
    /// Held while the batch runs: dropping it tells the batcher the batch is done.
    pub out: Out,
    /// The way to the tasks of its lane and bucket that arrive while it runs.
    pub joins: Joins<T>,
}

/// A running batch's way back to its queue: at a step boundary (a call of a step-by-step
/// bucket), it takes the tasks of its lane and bucket that arrived since, as many as it has
/// room for, and they join its next call. While it says it has room, the batcher keeps those
/// tasks for it rather than sending them out as a batch of their own.
#[derive(Debug)]
pub struct Joins<T> {
    key: Key,
    tx: mpsc::Sender<Join<T>>,
}

/// A running batch asks for up to `room` tasks of `key`; it keeps room for as many again after.
struct Join<T> {
    key: Key,
    room: usize,
    reply: oneshot::Sender<Vec<T>>,
}

impl<T> Joins<T> {
    /// The tasks of the batch's lane and bucket waiting now, at most `room` (nothing waits for
    /// more to come). `room` 0 says the batch takes no more: what arrives goes out as another
    /// batch.
    pub async fn take(&self, room: usize) -> Vec<T> {
        let (reply, rx) = oneshot::channel();
        let asked = Join {
            key: self.key.clone(),
            room,
            reply,
        };
        if self.tx.send(asked).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }
}

/// What the batcher queues by: a lane and a bucket.
type Key = (Priority, Bucket);

/// A batch out of the batcher; dropped when it has run.
#[derive(Debug)]
pub struct Out {
    key: Option<Key>,
    ended: mpsc::UnboundedSender<Key>,
}

impl Drop for Out {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let _ = self.ended.send(key);
        }
    }
}

/// Work the batcher queues: its priority lane and its tenant.
pub trait Work {
    fn lane(&self) -> Priority;
    fn tenant(&self) -> &str;
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

/// Where a queued task stands: when it arrived, and its order ([`Queued::order`]).
type Place = (Instant, (u64, u64));

struct Queued<T> {
    item: T,
    since: Instant,
    /// Its place: the tenants' fair start tag ([`Fair`]), then arrival.
    order: (u64, u64),
}

/// The tasks of one lane and bucket, oldest first.
struct Queue<T> {
    items: VecDeque<Queued<T>>,
    /// How many later arrivals went out before its oldest task ([`turns`]).
    overtaken: u32,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            items: VecDeque::new(),
            overtaken: 0,
        }
    }
}

/// The batcher actor: receives `(bucket, item)` and serves batch requests.
pub struct Batcher<T> {
    input: mpsc::Receiver<(Bucket, T)>,
    requests: mpsc::Receiver<oneshot::Sender<Batch<T>>>,
    queues: BTreeMap<Key, Queue<T>>,
    waiting: VecDeque<oneshot::Sender<Batch<T>>>,
    limits: Arc<dyn BatchLimits>,
    max_wait: Duration,
    closed: bool,
    admission: Admission,
    /// Batches out, per lane and bucket (no entry: none).
    out: HashMap<Key, usize>,
    out_total: usize,
    arrivals: u64,
    fair: Fair,
    ended_tx: mpsc::UnboundedSender<Key>,
    ended: mpsc::UnboundedReceiver<Key>,
    joins_tx: mpsc::Sender<Join<T>>,
    joins: mpsc::Receiver<Join<T>>,
    /// Per lane and bucket, the room its running batches said they have for tasks that arrive
    /// (none: no batch of it takes tasks while it runs).
    room: HashMap<Key, usize>,
}

impl<T: Work + Send + 'static> Batcher<T> {
    pub fn new(
        input: mpsc::Receiver<(Bucket, T)>,
        limits: Arc<dyn BatchLimits>,
        max_wait: Duration,
        admission: Admission,
    ) -> (Batcher<T>, BatchRequests<T>) {
        let (tx, requests) = mpsc::channel(16);
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let (joins_tx, joins) = mpsc::channel(16);
        let batcher = Batcher {
            input,
            requests,
            queues: BTreeMap::new(),
            waiting: VecDeque::new(),
            limits,
            max_wait,
            closed: false,
            admission: Admission {
                steady: admission.steady.max(1),
                most: admission.most.max(admission.steady.max(1)),
            },
            out: HashMap::new(),
            out_total: 0,
            arrivals: 0,
            fair: Fair::default(),
            ended_tx,
            ended,
            joins_tx,
            joins,
            room: HashMap::new(),
        };
        (batcher, BatchRequests { tx })
    }

    /// Shares the device between tenants by these weights (every tenant weighs 1 without).
    pub fn with_tenant_weights(mut self, weights: TenantWeights) -> Self {
        self.fair = Fair::new(weights);
        self
    }

    /// Whether a batch of `key` may go out now.
    fn may_take(&self, key: &Key) -> bool {
        self.out_total < self.admission.most && self.out.get(key).copied().unwrap_or(0) < self.admission.steady
    }

    /// The queues that may go out now and are ready: full, timed out, or the input closed.
    fn ready(&self, now: Instant) -> Vec<(Key, Waiter)> {
        self.queues
            .iter()
            .filter(|(key, _)| self.may_take(key))
            .filter_map(|(key, queue)| {
                let oldest = queue.items.front()?;
                if self.held(key, queue) {
                    return None;
                }
                let full = queue.items.len() >= self.limits.limit(&key.1);
                (full || now >= oldest.since + self.wait_of(key.0) || self.closed).then(|| {
                    let turn = Waiter {
                        overtaken: queue.overtaken,
                        ..Waiter::new(key.0, oldest.order.0)
                    };
                    (key.clone(), turn)
                })
            })
            .collect()
    }

    /// When the next queue that may go out times out. One that may not go out is woken by a
    /// batch's end instead.
    fn next_deadline(&self) -> Option<Instant> {
        self.queues
            .iter()
            .filter(|(key, q)| self.may_take(key) && !self.held(key, q))
            .filter_map(|(key, q)| Some(q.items.front()?.since + self.wait_of(key.0)))
            .min()
    }

    /// How long a partial batch of `lane` waits to fill: `max_wait`, except in the interactive
    /// lane, whose tasks have someone waiting on them and go at once. They still batch under
    /// load: those that arrive while the lane's batches out are at [`Admission::steady`] queue,
    /// and go out together.
    fn wait_of(&self, lane: Priority) -> Duration {
        match lane {
            Priority::Interactive => Duration::ZERO,
            _ => self.max_wait,
        }
    }

    fn ended(&mut self, key: Key) {
        self.room.remove(&key);
        self.out_total = self.out_total.saturating_sub(1);
        if let Some(n) = self.out.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.out.remove(&key);
            }
        }
    }

    /// A running batch of `key` takes up to `room` of its queued tasks, in their fair order, and
    /// says how much room it has left for the next ones.
    fn join(&mut self, Join { key, room, reply }: Join<T>) {
        let (items, places) = self.take(&key, room);
        let left = room - items.len();
        if left > 0 && self.out.contains_key(&key) {
            self.room.insert(key.clone(), left);
        } else {
            self.room.remove(&key);
        }
        if let Err(items) = reply.send(items) {
            // The batch went away: its tasks go back to the front.
            self.give_back(key, items, places);
        }
    }

    /// Up to `n` of the oldest tasks (in fair order) of `key`'s queue, with their places; the
    /// tenants' fair clock moves past them, and an emptied queue goes.
    fn take(&mut self, key: &Key, n: usize) -> (Vec<T>, Vec<Place>) {
        let Some(queue) = self.queues.get_mut(key) else {
            return (Vec::new(), Vec::new());
        };
        let n = n.min(queue.items.len());
        let (items, places): (Vec<T>, Vec<Place>) = queue.items.drain(..n).map(|q| (q.item, (q.since, q.order))).unzip();
        if let Some((_, (tag, _))) = places.last() {
            self.fair.served(*tag);
        }
        if queue.items.is_empty() {
            self.queues.remove(key);
        }
        (items, places)
    }

    /// Tasks [`Batcher::take`] took that nobody received, back at the front of their queue in
    /// their places.
    fn give_back(&mut self, key: Key, items: Vec<T>, places: Vec<Place>) {
        let queue = self.queues.entry(key).or_default();
        for (item, (since, order)) in items.into_iter().zip(places).rev() {
            queue.items.push_front(Queued { item, since, order });
        }
    }

    /// Whether a queue's tasks are kept for a running batch of its lane and bucket, which takes
    /// them at its next step.
    fn held(&self, key: &Key, queue: &Queue<T>) -> bool {
        self.room.get(key).is_some_and(|&room| queue.items.len() <= room)
    }

    /// Queues `item` in its lane and bucket, in its tenant's fair place.
    fn arrive(&mut self, bucket: Bucket, item: T) {
        self.arrivals += 1;
        let order = (self.fair.arrive(item.tenant(), bucket.rows_per_task), self.arrivals);
        let queue = &mut self.queues.entry((item.lane(), bucket)).or_default().items;
        let at = queue.partition_point(|q| q.order < order);
        queue.insert(
            at,
            Queued {
                item,
                since: Instant::now(),
                order,
            },
        );
    }

    /// Hands out batches while requests wait and a queue is ready: whose turn it is by
    /// [`turns`] (the best lane, then the oldest task; none overtaken more than the bound).
    fn serve(&mut self) {
        let now = Instant::now();
        while !self.waiting.is_empty() {
            let mut ready = self.ready(now);
            let Some(i) = turns::next(ready.iter().map(|(_, turn)| *turn)) else {
                break;
            };
            let (key, turn) = ready.swap_remove(i);
            turns::went_first(&turn, ready.iter_mut().map(|(_, t)| t));
            for (other, t) in &ready {
                self.queues.get_mut(other).expect("queued").overtaken = t.overtaken;
            }
            let limit = self.limits.limit(&key.1);
            self.queues.get_mut(&key).expect("queued").overtaken = 0;
            let (items, places) = self.take(&key, limit);
            let n = items.len();
            let reply = self.waiting.pop_front().expect("a waiting request");
            if n < limit && self.limits.takes_joins(key.0, &key.1) {
                // What arrives before its first step boundary is kept for it too.
                self.room.insert(key.clone(), limit - n);
            }
            *self.out.entry(key.clone()).or_default() += 1;
            self.out_total += 1;
            let out = Out {
                key: Some(key.clone()),
                ended: self.ended_tx.clone(),
            };
            let joins = Joins {
                key: key.clone(),
                tx: self.joins_tx.clone(),
            };
            if let Err(batch) = reply.send(Batch {
                bucket: key.1.clone(),
                items,
                out,
                joins,
            }) {
                // The requester went away; keep its tasks at the front.
                self.give_back(key, batch.items, places);
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
                    Some((bucket, item)) => self.arrive(bucket, item),
                    None => self.closed = true,
                },
                request = self.requests.recv() => match request {
                    Some(reply) => self.waiting.push_back(reply),
                    None => return,
                },
                Some(key) = self.ended.recv() => self.ended(key),
                Some(join) = self.joins.recv() => self.join(join),
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

    impl Work for i32 {
        fn lane(&self) -> Priority {
            Priority::Standard
        }
        fn tenant(&self) -> &str {
            "t"
        }
    }

    /// A task of a lane, by its number.
    #[derive(Debug, PartialEq)]
    struct Of(Priority, i32);
    impl Work for Of {
        fn lane(&self) -> Priority {
            self.0
        }
        fn tenant(&self) -> &str {
            "t"
        }
    }

    /// A task of a tenant, by its number.
    #[derive(Debug, PartialEq)]
    struct By(&'static str, i32);
    impl Work for By {
        fn lane(&self) -> Priority {
            Priority::Standard
        }
        fn tenant(&self) -> &str {
            self.0
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
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(3)), Duration::from_millis(50), Admission::for_slots(4));
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

    #[tokio::test(start_paused = true)]
    async fn an_interactive_task_does_not_wait_for_its_batch_to_fill() {
        let (tx, rx) = mpsc::channel(8);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(4)), Duration::from_millis(50), Admission::for_slots(4));
        tokio::spawn(batcher.run());
        tx.send((bucket(1), Of(Priority::Standard, 1))).await.unwrap();
        tx.send((bucket(1), Of(Priority::Interactive, 2))).await.unwrap();
        let started = Instant::now();
        let first = requests.next().await.unwrap();
        assert_eq!(first.items, vec![Of(Priority::Interactive, 2)]);
        assert!(started.elapsed() < Duration::from_millis(50), "the interactive task went at once");
        let second = requests.next().await.unwrap();
        assert_eq!(second.items, vec![Of(Priority::Standard, 1)]);
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "the standard one waited to fill its batch"
        );
    }

    #[tokio::test]
    async fn idles_without_spinning_when_nobody_asks() {
        let (tx, rx) = mpsc::channel(8);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(4)), Duration::from_millis(1), Admission::for_slots(1));
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

    /// A running batcher of one-task batches (max_wait 5 ms) under `admission`: its input and
    /// its requests.
    fn one_task_batches<T: Work + Send + 'static>(admission: Admission) -> (mpsc::Sender<(Bucket, T)>, BatchRequests<T>) {
        let (tx, rx) = mpsc::channel(256);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(1)), Duration::from_millis(5), admission);
        tokio::spawn(batcher.run());
        (tx, requests)
    }

    /// Asks for a batch and gives up after `wait` (paused time): what the batcher handed out.
    async fn next_within<T>(requests: &BatchRequests<T>, wait: Duration) -> Option<Batch<T>> {
        tokio::time::timeout(wait, requests.next()).await.ok().flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn each_bucket_has_at_most_steady_batches_out_and_all_together_most() {
        let (tx, requests) = one_task_batches(Admission { steady: 2, most: 5 });
        // Four one-task batches of a long bucket, then three of another and one of a third.
        for i in 0..4 {
            tx.send((bucket(64), i)).await.unwrap();
        }
        for i in 100..103 {
            tx.send((bucket(1), i)).await.unwrap();
        }
        tx.send((bucket(2), 200)).await.unwrap();
        let mut out = Vec::new();
        for _ in 0..5 {
            out.push(next_within(&requests, Duration::from_secs(1)).await.expect("below the bounds"));
        }
        let items: Vec<i32> = out.iter().map(|b| b.items[0]).collect();
        assert_eq!(items, vec![0, 1, 100, 101, 200], "oldest first, two of a bucket at most");
        // Five out, the most: nothing more, though bucket 1 has a task left.
        assert!(next_within(&requests, Duration::from_secs(1)).await.is_none(), "past most");
        drop(out.remove(4)); // 200 ended: bucket 1 still has two out, the long one too
        assert!(next_within(&requests, Duration::from_secs(1)).await.is_none(), "steady per bucket");
        drop(out.remove(2)); // 100 ended
        assert_eq!(next_within(&requests, Duration::from_secs(1)).await.unwrap().items, vec![102]);
        drop(out.remove(0)); // 0 ended
        assert_eq!(next_within(&requests, Duration::from_secs(1)).await.unwrap().items, vec![2]);
        drop(out);
        assert_eq!(requests.next().await.unwrap().items, vec![3]);
        drop(tx);
        assert!(requests.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_whose_requester_went_away_is_queued_again_and_not_counted_out() {
        let (tx, requests) = one_task_batches(Admission { steady: 1, most: 1 });
        // A request that gives up before the batcher has anything for it.
        assert!(next_within(&requests, Duration::from_millis(1)).await.is_none());
        tx.send((bucket(1), 1)).await.unwrap();
        tx.send((bucket(1), 2)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let first = requests.next().await.expect("the task given back is handed out again");
        assert_eq!(first.items, vec![1]);
        drop(first);
        assert_eq!(requests.next().await.unwrap().items, vec![2]);
    }

    #[tokio::test(start_paused = true)]
    async fn lanes_go_best_first_and_batch_work_waits_at_most_the_bound() {
        use Priority::*;
        // One batch out at a time: every handout is a choice.
        let (tx, requests) = one_task_batches(Admission { steady: 1, most: 1 });
        tx.send((bucket(1), Of(Batch, 0))).await.unwrap();
        tx.send((bucket(1), Of(Standard, 1))).await.unwrap();
        tx.send((bucket(1), Of(Interactive, 2))).await.unwrap();
        // All three queued before the first request.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut order = Vec::new();
        for _ in 0..3 {
            let batch = requests.next().await.unwrap();
            order.push(batch.items[0].1);
        }
        assert_eq!(order, vec![2, 1, 0], "interactive, standard, batch");
        // A batch task, then interactive ones arriving faster than they are served: the batch
        // task goes out after at most MAX_OVERTAKEN of them.
        tx.send((bucket(1), Of(Batch, 100))).await.unwrap();
        let mut served_before = 0;
        for i in 0..100 {
            tx.send((bucket(2), Of(Interactive, 200 + 2 * i))).await.unwrap();
            tx.send((bucket(3), Of(Interactive, 201 + 2 * i))).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let batch = requests.next().await.unwrap();
            if batch.items[0].0 == Batch {
                break;
            }
            served_before += 1;
        }
        assert_eq!(served_before, turns::MAX_OVERTAKEN as usize);
    }

    #[tokio::test(start_paused = true)]
    async fn tasks_a_running_batch_has_room_for_wait_for_its_next_step_not_for_a_batch() {
        let (tx, rx) = mpsc::channel(64);
        let (batcher, requests) = Batcher::new(rx, Arc::new(Fixed(4)), Duration::from_millis(5), Admission::for_slots(1));
        tokio::spawn(batcher.run());
        tx.send((bucket(1), 1)).await.unwrap();
        let running = requests.next().await.unwrap();
        assert_eq!(running.items, vec![1]);
        // At its first step boundary nothing waits; it has room for two.
        assert!(running.joins.take(2).await.is_empty());
        tx.send((bucket(1), 2)).await.unwrap();
        tx.send((bucket(1), 3)).await.unwrap();
        tx.send((bucket(2), 100)).await.unwrap();
        let other = next_within(&requests, Duration::from_secs(1))
            .await
            .expect("another bucket goes out");
        assert_eq!(other.items, vec![100]);
        assert!(
            next_within(&requests, Duration::from_secs(1)).await.is_none(),
            "kept for the running batch"
        );
        assert_eq!(running.joins.take(2).await, vec![2, 3]);
        // No room left: what arrives goes out as a batch of its own.
        tx.send((bucket(1), 4)).await.unwrap();
        let second = next_within(&requests, Duration::from_secs(1)).await.expect("a batch of its own");
        assert_eq!(second.items, vec![4]);
        // Room again; then the batches end before taking what came: it goes out.
        assert!(second.joins.take(3).await.is_empty());
        tx.send((bucket(1), 5)).await.unwrap();
        assert!(next_within(&requests, Duration::from_secs(1)).await.is_none(), "kept");
        drop((running, second, other));
        assert_eq!(next_within(&requests, Duration::from_secs(1)).await.unwrap().items, vec![5]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_is_not_held_behind_another_tenants_flood() {
        let (tx, requests) = one_task_batches(Admission { steady: 1, most: 1 });
        for i in 0..40 {
            tx.send((bucket(1), By("flood", i))).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        for _ in 0..5 {
            assert_eq!(requests.next().await.unwrap().items[0].0, "flood");
        }
        tx.send((bucket(1), By("light", 100))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut next = Vec::new();
        for _ in 0..2 {
            // Each batch dropped (ended) before the next is asked for: one out at most.
            next.push(requests.next().await.unwrap().items[0].0);
        }
        assert!(next.contains(&"light"), "behind the flood: {next:?}");
    }
}
