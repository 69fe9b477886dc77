//! Adaptive batch backoff. On out-of-memory the batch is halved and the same tasks run again,
//! down to one; a bucket at one runs its device work through an exclusive permit; a task that
//! does not fit even alone fails on its own. The largest size that works is remembered per
//! bucket and probed upwards slowly, so a transient OOM does not pin it low forever.
//!
//! Nothing here knows of Kafka: items are anything with prepared inputs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::{Call, CallTask, Engine, EngineError, Tensor};
use crate::events::{self, Emit};
use crate::metrics::Metrics;
use crate::models::{Bucket, Prepared, concat_inputs};

/// The learned batch ceiling of one bucket (tasks per model call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ceiling {
    limit: usize,
    max: usize,
    /// Clean full batches since the last change.
    streak: u32,
    /// Clean full batches required before probing one task higher.
    probe_every: u32,
    base_probe_every: u32,
    /// The limit was just raised; the next full batch tests it.
    probing: bool,
}

/// Longest wait between probes after failed ones, in clean batches (×base).
const MAX_PROBE_BACKOFF: u32 = 64;

impl Ceiling {
    pub fn new(max: usize, probe_after: u32) -> Ceiling {
        let max = max.max(1);
        let probe_after = probe_after.max(1);
        Ceiling {
            limit: max,
            max,
            streak: 0,
            probe_every: probe_after,
            base_probe_every: probe_after,
            probing: false,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A batch of `size` ran. Returns the new limit when this success earned a probe.
    pub fn on_success(&mut self, size: usize) -> Option<usize> {
        if size < self.limit {
            return None; // a partial batch says nothing about the limit
        }
        if std::mem::take(&mut self.probing) {
            self.probe_every = self.base_probe_every;
        }
        self.streak += 1;
        if self.streak >= self.probe_every && self.limit < self.max {
            self.limit += 1;
            self.streak = 0;
            self.probing = true;
            return Some(self.limit);
        }
        None
    }

    /// A batch of `size` ran out of memory. Returns the new limit.
    pub fn on_oom(&mut self, size: usize) -> usize {
        self.streak = 0;
        if self.probing && size == self.limit {
            // The probe failed: go back to the size that worked and wait longer before the next.
            self.probing = false;
            self.limit = size.saturating_sub(1).max(1);
            self.probe_every = (self.probe_every * 2).min(self.base_probe_every * MAX_PROBE_BACKOFF);
        } else {
            self.probing = false;
            self.limit = self.limit.min((size / 2).max(1));
        }
        self.limit
    }
}

/// Something that can be batched: its prepared inputs, and how to name it in logs.
pub trait BatchItem: Send + 'static {
    fn prepared(&self) -> &Prepared;
    /// Task id for logs.
    fn id(&self) -> String;
    /// Dimensions for logs and the DLQ.
    fn dimensions(&self) -> String;
    /// Progress and cancellation of the task, for models with many steps.
    fn hooks(&self) -> Option<Arc<dyn crate::engine::TaskHooks>> {
        None
    }
}

/// The model call of a chunk: inputs concatenated in item order, and each item's rows.
fn call_of<T: BatchItem>(bucket: &Bucket, items: &[T]) -> Call {
    let prepared: Vec<&Prepared> = items.iter().map(BatchItem::prepared).collect();
    Call {
        key: bucket.key.clone(),
        inputs: concat_inputs(&prepared),
        tasks: items
            .iter()
            .map(|i| CallTask {
                id: i.id(),
                rows: i.prepared().rows,
                hooks: i.hooks(),
            })
            .collect(),
    }
}

/// Task ids and dimensions of `items`, for events.
fn names<T: BatchItem>(items: &[T]) -> (Vec<String>, Vec<String>) {
    (
        items.iter().map(BatchItem::id).collect(),
        items.iter().map(BatchItem::dimensions).collect(),
    )
}

/// What became of a chunk of a batch.
pub enum Done<T> {
    /// The chunk ran. The items own consecutive rows of every output, in order, each as many
    /// as its prepared inputs have.
    Ran {
        items: Vec<T>,
        outputs: Arc<Vec<Tensor>>,
        elapsed: Duration,
        batch_size: usize,
    },
    /// This item failed on its own: out of memory even alone, or a model error isolated to it.
    Failed { item: T, error: EngineError },
}

/// Configured upper bounds of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSize {
    pub max_tasks: usize,
    pub max_rows: usize,
}

/// The most buckets whose ceilings are kept; a forgotten one is learned again from the start.
pub const MAX_CEILINGS: usize = 512;

/// Runs batches adaptively on the engine.
pub struct Adaptive {
    engine: Engine,
    /// Learned ceilings, at most [`MAX_CEILINGS`]: the least recently used goes first.
    ceilings: Mutex<HashMap<Bucket, (Ceiling, u64)>>,
    /// Uses so far, to order the ceilings by their last use.
    uses: std::sync::atomic::AtomicU64,
    max_batch: usize,
    max_rows: usize,
    probe_after: u32,
    serialize_singles: bool,
    metrics: Metrics,
}

struct Chunk<T> {
    items: Vec<T>,
    /// Run alone on the device (a single retried after an OOM, or a bucket down to one).
    exclusive: bool,
}

impl Adaptive {
    pub fn new(engine: Engine, limits: BatchSize, probe_after: u32, serialize_singles: bool, metrics: Metrics) -> Adaptive {
        Adaptive {
            engine,
            ceilings: Mutex::new(HashMap::new()),
            uses: std::sync::atomic::AtomicU64::new(0),
            max_batch: limits.max_tasks.max(1),
            max_rows: limits.max_rows.max(1),
            probe_after,
            serialize_singles,
            metrics,
        }
    }

    /// The most tasks of `bucket` one call may take: the task cap, or fewer to stay within the
    /// row cap (never below one).
    fn max_for(&self, bucket: &Bucket) -> usize {
        self.max_batch.min(self.max_rows / bucket.rows_per_task.max(1)).max(1)
    }

    /// The current limit of `bucket` (tasks per call).
    pub fn limit(&self, bucket: &Bucket) -> usize {
        if bucket.alone.is_some() {
            return 1; // a crash suspect runs in a call of its own
        }
        self.with_ceiling(bucket, |c| c.limit())
    }

    /// Runs `f` on the ceiling of `bucket` (a crash suspect's is its shape's), made (and
    /// reported) on first use.
    fn with_ceiling<R>(&self, bucket: &Bucket, f: impl FnOnce(&mut Ceiling) -> R) -> R {
        let shape;
        let bucket = if bucket.alone.is_some() {
            shape = Bucket {
                alone: None,
                ..bucket.clone()
            };
            &shape
        } else {
            bucket
        };
        let mut ceilings = self.ceilings.lock().expect("ceilings");
        let now = self.uses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if ceilings.len() >= MAX_CEILINGS && !ceilings.contains_key(bucket) {
            // Buckets are as many as the requests clients can make: forget the stalest.
            if let Some(stalest) = ceilings.iter().min_by_key(|(_, (_, used))| *used).map(|(b, _)| b.clone()) {
                ceilings.remove(&stalest);
            }
        }
        let (ceiling, used) = ceilings.entry(bucket.clone()).or_insert_with(|| {
            let c = Ceiling::new(self.max_for(bucket), self.probe_after);
            events::CeilingIs { bucket, limit: c.limit() }.emit(&self.metrics);
            (c, now)
        });
        *used = now;
        f(ceiling)
    }

    /// Changes the ceiling of `bucket` through `f` and reports its limit.
    fn update<R>(&self, bucket: &Bucket, f: impl FnOnce(&mut Ceiling) -> R) -> R {
        self.with_ceiling(bucket, |c| {
            let r = f(c);
            events::CeilingIs { bucket, limit: c.limit() }.emit(&self.metrics);
            r
        })
    }

    /// Runs `items` as one model call; or, one task with more rows than a call may take, as
    /// consecutive calls of at most the row cap whose outputs are joined, so that the size of
    /// a request never sets the size of a call. An error in any part is the task's.
    async fn call<T: BatchItem>(&self, bucket: &Bucket, items: &[T], exclusive: bool) -> Result<Vec<Tensor>, EngineError> {
        let call = call_of(bucket, items);
        let rows: usize = call.tasks.iter().map(|t| t.rows).sum();
        // Only inputs that are all one row per task row can be cut into parts.
        let by_rows = call.inputs.iter().all(|t| t.shape.first() == Some(&rows));
        if call.tasks.len() != 1 || rows <= self.max_rows || !by_rows {
            return self.engine.run(&bucket.model, call, exclusive).await;
        }
        let task = &call.tasks[0];
        tracing::debug!(task_id = %task.id, rows, max_rows = self.max_rows, "running the task in parts of the row cap");
        let mut parts: Vec<Vec<Tensor>> = Vec::new();
        for start in (0..rows).step_by(self.max_rows) {
            let end = (start + self.max_rows).min(rows);
            let part = Call {
                key: call.key.clone(),
                inputs: call.inputs.iter().map(|t| t.slice_rows(start, end)).collect(),
                tasks: vec![CallTask {
                    rows: end - start,
                    ..task.clone()
                }],
            };
            parts.push(self.engine.run(&bucket.model, part, exclusive).await?);
        }
        let outputs = parts[0].len();
        if let Some(odd) = parts.iter().find(|p| p.len() != outputs) {
            return Err(EngineError::Run(format!(
                "the model gave {} outputs for one part of a task and {outputs} for another",
                odd.len()
            )));
        }
        Ok((0..outputs)
            .map(|i| Tensor::concat(&parts.iter().map(|p| &p[i]).collect::<Vec<_>>()))
            .collect())
    }

    /// Runs `items` (all of `bucket`) and reports each chunk as it finishes, so that CPU work on
    /// its results overlaps the next chunk's inference.
    pub async fn run<T: BatchItem>(&self, bucket: &Bucket, items: Vec<T>, mut on_done: impl FnMut(Done<T>)) {
        let mut pending: VecDeque<T> = items.into();
        // Chunks to run before taking new ones from `pending`: halves of a chunk whose model error
        // is being isolated, or a single retried alone after an OOM.
        let mut retries: VecDeque<Chunk<T>> = VecDeque::new();
        loop {
            let chunk = match retries.pop_front() {
                Some(chunk) => chunk,
                None if pending.is_empty() => break,
                None => {
                    let n = self.limit(bucket).min(pending.len());
                    let items: Vec<T> = pending.drain(..n).collect();
                    // A bucket down to one serializes its device work.
                    let exclusive = n == 1 && self.serialize_singles && self.limit(bucket) == 1;
                    Chunk { items, exclusive }
                }
            };
            let size = chunk.items.len();
            let started = Instant::now();
            let result = self.call(bucket, &chunk.items, chunk.exclusive).await;
            let elapsed = started.elapsed();
            match result {
                Ok(outputs) => {
                    events::BatchRan { bucket, size, elapsed }.emit(&self.metrics);
                    if let Some(to) = self.update(bucket, |c| c.on_success(size)) {
                        events::CeilingProbed { bucket, to }.emit(&self.metrics);
                    }
                    on_done(Done::Ran {
                        items: chunk.items,
                        outputs: Arc::new(outputs),
                        elapsed,
                        batch_size: size,
                    });
                }
                Err(error) if error.is_oom() => {
                    self.engine.release_memory(&bucket.model);
                    let (task_ids, dimensions) = names(&chunk.items);
                    if size > 1 {
                        let to = self.update(bucket, |c| c.on_oom(size));
                        events::OomHandled {
                            bucket,
                            from: size,
                            to,
                            task_ids,
                            dimensions,
                            error: &error,
                        }
                        .emit(&self.metrics);
                        // The same tasks again, at the new size.
                        for item in chunk.items.into_iter().rev() {
                            pending.push_front(item);
                        }
                    } else if !chunk.exclusive && self.serialize_singles {
                        // Alone but beside other runs: try once more with the device to itself.
                        self.update(bucket, |c| c.on_oom(1));
                        events::OomHandled {
                            bucket,
                            from: 1,
                            to: 1,
                            task_ids,
                            dimensions,
                            error: &error,
                        }
                        .emit(&self.metrics);
                        retries.push_front(Chunk {
                            items: chunk.items,
                            exclusive: true,
                        });
                    } else {
                        self.update(bucket, |c| c.on_oom(1));
                        events::DoesNotFit {
                            bucket,
                            task_id: &task_ids[0],
                            dimensions: &dimensions[0],
                            error: &error,
                        }
                        .emit(&self.metrics);
                        let item = chunk.items.into_iter().next().expect("one item");
                        on_done(Done::Failed { item, error });
                    }
                }
                Err(error) if error.is_task_error() && size > 1 => {
                    // A model error or panic inside a batch: isolate it by bisection so the
                    // others run.
                    events::Bisected {
                        bucket,
                        size,
                        error: &error,
                    }
                    .emit(&self.metrics);
                    let mut items = chunk.items;
                    let second = items.split_off(size / 2);
                    retries.push_front(Chunk {
                        items: second,
                        exclusive: chunk.exclusive,
                    });
                    retries.push_front(Chunk {
                        items,
                        exclusive: chunk.exclusive,
                    });
                }
                Err(error) => {
                    for item in chunk.items {
                        on_done(Done::Failed {
                            item,
                            error: error.clone(),
                        });
                    }
                }
            }
        }
    }
}

impl crate::batcher::BatchLimits for Adaptive {
    fn limit(&self, bucket: &Bucket) -> usize {
        Adaptive::limit(self, bucket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{Device, ERROR_SEED, FakeModel, PANIC_SEED, prepared};
    use crate::models::ModelAdapter;

    struct Item(Prepared, String);

    impl BatchItem for Item {
        fn prepared(&self) -> &Prepared {
            &self.0
        }
        fn id(&self) -> String {
            self.1.clone()
        }
        fn dimensions(&self) -> String {
            format!("1x1x{}", self.0.rows)
        }
    }

    fn bucket(rows: usize) -> Bucket {
        Bucket {
            key: String::new(),
            model: "fake".into(),
            rows_per_task: rows,
            alone: None,
        }
    }

    /// An adaptive runner over `slots` engine threads sharing a fake device of `capacity` rows.
    async fn adaptive(
        capacity: usize,
        slots: usize,
        max: usize,
        probe_after: u32,
        serialize: bool,
    ) -> (Arc<Adaptive>, Arc<Device>, Metrics) {
        let device = Device::new(capacity, Duration::from_millis(20));
        let engine = Engine::start(slots);
        let model = Arc::new(FakeModel { device: device.clone() });
        engine
            .load("fake", Arc::new(move || model.load(std::path::Path::new(""), &Default::default())))
            .await
            .unwrap();
        let metrics = Metrics::new();
        let limits = BatchSize {
            max_tasks: max,
            max_rows: 1024,
        };
        (
            Arc::new(Adaptive::new(engine, limits, probe_after, serialize, metrics.clone())),
            device,
            metrics,
        )
    }

    fn items(seeds: impl IntoIterator<Item = u64>, rows: usize) -> Vec<Item> {
        seeds.into_iter().map(|s| Item(prepared(s, rows), s.to_string())).collect()
    }

    /// Runs `items` as one batch: the sizes of the calls that ran, the ids that ran, and the
    /// failures.
    async fn run(a: &Adaptive, b: &Bucket, items: Vec<Item>) -> (Vec<usize>, Vec<String>, Vec<(String, EngineError)>) {
        let (mut sizes, mut ran, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        a.run(b, items, |done| match done {
            Done::Ran { items, batch_size, .. } => {
                sizes.push(batch_size);
                ran.extend(items.iter().map(|i| i.1.clone()));
            }
            Done::Failed { item, error } => failed.push((item.1, error)),
        })
        .await;
        (sizes, ran, failed)
    }

    #[tokio::test]
    async fn an_oom_halves_the_batch_runs_the_same_tasks_and_remembers_the_size() {
        let (a, device, metrics) = adaptive(4, 1, 8, 16, true).await;
        let (sizes, ran, failed) = run(&a, &bucket(1), items(0..8, 1)).await;
        assert_eq!(sizes, vec![4, 4]);
        assert_eq!(ran.len(), 8);
        assert!(failed.is_empty());
        assert_eq!(a.limit(&bucket(1)), 4, "learned");
        assert_eq!(metrics.ooms(&bucket(1)), 1);
        assert!(device.peak.load(std::sync::atomic::Ordering::SeqCst) <= 4);
        // The next batch starts at the learned size: no OOM.
        let (sizes, _, _) = run(&a, &bucket(1), items(10..16, 1)).await;
        assert_eq!(sizes, vec![4, 2]);
        assert_eq!(metrics.ooms(&bucket(1)), 1);
    }

    /// A task with more rows than a call may take runs in parts of the row cap: the device
    /// never holds more than the cap, and the task gets all its rows, in order.
    #[tokio::test]
    async fn a_task_larger_than_the_row_cap_runs_in_parts() {
        let device = Device::new(4, Duration::from_millis(1));
        let engine = Engine::start(1);
        let model = Arc::new(FakeModel { device: device.clone() });
        engine
            .load("fake", Arc::new(move || model.load(std::path::Path::new(""), &Default::default())))
            .await
            .unwrap();
        let limits = BatchSize { max_tasks: 8, max_rows: 4 };
        let a = Adaptive::new(engine, limits, 16, true, Metrics::new());
        let mut task = prepared(3, 10);
        task.inputs[0] = Tensor::f32("x", vec![10, 1], (0..10).map(|r| r as f32).collect());
        let mut outputs = Vec::new();
        a.run(&bucket(10), vec![Item(task, "big".into())], |done| match done {
            Done::Ran { outputs: o, .. } => outputs.push(o),
            Done::Failed { error, .. } => panic!("{error}"),
        })
        .await;
        let y = &outputs[0][0];
        assert_eq!(y.shape, vec![10, 1]);
        let want: Vec<f32> = (0..10).map(|r| 2.0 * r as f32).collect();
        assert_eq!(y.f32_rows(0, 10).unwrap(), want.as_slice());
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 3, "4 + 4 + 2 rows");
        assert!(device.peak.load(std::sync::atomic::Ordering::SeqCst) <= 4);
    }

    /// Buckets are as many as the requests clients can make; the learned ceilings are not.
    #[tokio::test]
    async fn the_ceilings_kept_are_bounded() {
        let a = Adaptive::new(
            Engine::start(1),
            BatchSize {
                max_tasks: 8,
                max_rows: 64,
            },
            16,
            true,
            Metrics::new(),
        );
        for rows in 1..=(MAX_CEILINGS + 100) {
            let b = Bucket {
                rows_per_task: rows,
                ..bucket(1)
            };
            a.limit(&b);
        }
        a.limit(&bucket(MAX_CEILINGS + 100)); // the most recent one stays
        let ceilings = a.ceilings.lock().unwrap();
        assert_eq!(ceilings.len(), MAX_CEILINGS);
        assert!(ceilings.contains_key(&bucket(MAX_CEILINGS + 100)) && !ceilings.contains_key(&bucket(1)));
    }

    #[tokio::test]
    async fn a_task_that_does_not_fit_even_alone_fails_on_its_own() {
        let (a, _, metrics) = adaptive(4, 1, 8, 16, true).await;
        let (sizes, ran, failed) = run(&a, &bucket(5), items([1, 2], 5)).await;
        assert!(sizes.is_empty() && ran.is_empty());
        assert_eq!(failed.len(), 2);
        assert!(failed.iter().all(|(_, e)| e.is_oom()));
        assert_eq!(a.limit(&bucket(5)), 1);
        // Halved once (2 -> 1); the bucket is then down to one, so each runs alone with the
        // device to itself at once, and fails there.
        assert_eq!(metrics.ooms(&bucket(5)), 1 + 2);
        // Other buckets are not affected.
        assert_eq!(run(&a, &bucket(1), items(0..4, 1)).await.0, vec![4]);
    }

    #[tokio::test]
    async fn singles_share_the_device_only_through_the_exclusive_permit() {
        for serialize in [true, false] {
            // Two engine slots, a device that holds one row: two singles side by side don't fit.
            let (a, device, _) = adaptive(1, 2, 1, 16, serialize).await;
            let runs = (0..2).map(|i| {
                let a = a.clone();
                tokio::spawn(async move { run(&a, &bucket(1), items([i], 1)).await })
            });
            let results = futures::future::join_all(runs).await;
            let failed: usize = results.iter().map(|r| r.as_ref().unwrap().2.len()).sum();
            if serialize {
                assert_eq!(failed, 0, "the permit serializes them");
                assert_eq!(device.peak.load(std::sync::atomic::Ordering::SeqCst), 1);
            } else {
                assert!(failed >= 1, "without the permit they fail each other");
            }
        }
    }

    #[tokio::test]
    async fn the_ceiling_is_probed_after_clean_batches_and_a_failed_probe_backs_off() {
        let (a, _, metrics) = adaptive(4, 1, 8, 2, true).await;
        // 8 -> OOM -> 4, 4: two clean full batches earn a probe.
        assert_eq!(run(&a, &bucket(1), items(0..8, 1)).await.0, vec![4, 4]);
        assert_eq!(a.limit(&bucket(1)), 5, "probing one more");
        // The probe of 5 fails: back to 4 (not halved), and the rest run.
        assert_eq!(run(&a, &bucket(1), items(10..16, 1)).await.0, vec![4, 2]);
        assert_eq!(a.limit(&bucket(1)), 4);
        assert_eq!(metrics.ooms(&bucket(1)), 2);
        // The next probe waits twice as long: two clean full batches are no longer enough.
        assert_eq!(run(&a, &bucket(1), items(20..28, 1)).await.0, vec![4, 4]);
        assert_eq!(a.limit(&bucket(1)), 4);
        assert_eq!(run(&a, &bucket(1), items(30..38, 1)).await.0, vec![4, 4]);
        assert_eq!(a.limit(&bucket(1)), 5, "probing again after four");
    }

    #[tokio::test]
    async fn a_task_that_fails_or_panics_is_isolated_by_bisection() {
        let (a, _, _) = adaptive(64, 1, 8, 16, true).await;
        let seeds = [1, 2, PANIC_SEED, 4, 5, ERROR_SEED, 7, 8];
        let (_, ran, failed) = run(&a, &bucket(1), items(seeds, 1)).await;
        assert_eq!(ran.len(), 6, "every other task ran: {ran:?}");
        assert_eq!(failed.len(), 2);
        let by_id: HashMap<_, _> = failed.into_iter().collect();
        assert!(matches!(&by_id[&PANIC_SEED.to_string()], EngineError::Panicked(m) if m.contains("panicking task")));
        assert!(matches!(&by_id[&ERROR_SEED.to_string()], EngineError::Run(_)));
        assert_eq!(a.limit(&bucket(1)), 8, "model errors say nothing about memory");
    }

    #[test]
    fn halves_on_oom_and_never_below_one() {
        let mut c = Ceiling::new(16, 4);
        assert_eq!(c.on_oom(16), 8);
        assert_eq!(c.on_oom(8), 4);
        assert_eq!(c.on_oom(4), 2);
        assert_eq!(c.on_oom(2), 1);
        assert_eq!(c.on_oom(1), 1);
    }

    #[test]
    fn an_oom_of_a_smaller_batch_does_not_raise_the_limit() {
        let mut c = Ceiling::new(16, 4);
        c.on_oom(16); // 8
        assert_eq!(c.on_oom(20), 8);
    }

    #[test]
    fn probes_up_after_clean_full_batches_only() {
        let mut c = Ceiling::new(8, 3);
        c.on_oom(8); // 4
        assert_eq!(c.on_success(2), None, "partial batches don't count");
        assert_eq!(c.on_success(4), None);
        assert_eq!(c.on_success(4), None);
        assert_eq!(c.on_success(4), Some(5));
        assert_eq!(c.limit(), 5);
    }

    #[test]
    fn a_failed_probe_goes_back_one_and_waits_longer() {
        let mut c = Ceiling::new(8, 2);
        c.on_oom(8); // 4
        c.on_success(4);
        assert_eq!(c.on_success(4), Some(5));
        assert_eq!(c.on_oom(5), 4, "back to the size that worked, not halved");
        // Now it takes twice as many clean batches to probe again.
        for _ in 0..3 {
            assert_eq!(c.on_success(4), None);
        }
        assert_eq!(c.on_success(4), Some(5));
        // A successful probe resets the wait.
        assert_eq!(c.on_success(5), None);
        assert_eq!(c.on_success(5), Some(6));
    }

    #[test]
    fn never_probes_past_max() {
        let mut c = Ceiling::new(2, 1);
        assert_eq!(c.on_success(2), None);
        assert_eq!(c.limit(), 2);
    }
}
