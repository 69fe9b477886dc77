//! Adaptive batch backoff. On out-of-memory the batch is halved and the same tasks run again,
//! down to one; a bucket at one runs its device work through an exclusive permit; a task that
//! does not fit even alone fails on its own. The largest size that works is remembered per
//! bucket and probed upwards slowly, so a transient OOM does not pin it low forever.
//!
//! Nothing here knows of Kafka: items are anything with prepared inputs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::{Engine, EngineError, Tensor};
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

/// Runs batches adaptively on the engine.
pub struct Adaptive {
    engine: Engine,
    ceilings: Mutex<HashMap<Bucket, Ceiling>>,
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

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The current limit of `bucket` (tasks per call).
    pub fn limit(&self, bucket: &Bucket) -> usize {
        let mut ceilings = self.ceilings.lock().expect("ceilings");
        let ceiling = ceilings.entry(bucket.clone()).or_insert_with(|| {
            let c = Ceiling::new(self.max_for(bucket), self.probe_after);
            self.metrics
                .batch_ceiling
                .with_label_values(&[&bucket.to_string()])
                .set(c.limit() as i64);
            c
        });
        ceiling.limit()
    }

    /// Learned limits of every bucket seen so far.
    pub fn limits(&self) -> Vec<(Bucket, usize)> {
        let mut v: Vec<_> = self
            .ceilings
            .lock()
            .expect("ceilings")
            .iter()
            .map(|(b, c)| (b.clone(), c.limit()))
            .collect();
        v.sort();
        v
    }

    fn update<R>(&self, bucket: &Bucket, f: impl FnOnce(&mut Ceiling) -> R) -> R {
        let mut ceilings = self.ceilings.lock().expect("ceilings");
        let ceiling = ceilings
            .entry(bucket.clone())
            .or_insert_with(|| Ceiling::new(self.max_for(bucket), self.probe_after));
        let r = f(ceiling);
        self.metrics
            .batch_ceiling
            .with_label_values(&[&bucket.to_string()])
            .set(ceiling.limit() as i64);
        r
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
            let inputs = concat_inputs(&chunk.items.iter().map(|i| i.prepared()).collect::<Vec<_>>());
            let started = Instant::now();
            let result = self.engine.run(&bucket.model, inputs, chunk.exclusive).await;
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
                    if size > 1 {
                        let to = self.update(bucket, |c| c.on_oom(size));
                        events::OomHandled {
                            bucket,
                            from: size,
                            to,
                            items: &chunk.items,
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
                            items: &chunk.items,
                            error: &error,
                        }
                        .emit(&self.metrics);
                        retries.push_front(Chunk {
                            items: chunk.items,
                            exclusive: true,
                        });
                    } else {
                        self.update(bucket, |c| c.on_oom(1));
                        let item = chunk.items.into_iter().next().expect("one item");
                        events::DoesNotFit {
                            bucket,
                            item: &item,
                            error: &error,
                        }
                        .emit(&self.metrics);
                        on_done(Done::Failed { item, error });
                    }
                }
                Err(EngineError::Run(_)) if size > 1 => {
                    // A model error inside a batch: isolate it by bisection so the others run.
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
