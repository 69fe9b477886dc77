//! Adaptive batch backoff. On out-of-memory the batch is halved and the same tasks run again,
//! down to one; a task alone whose rows don't fit together runs its rows in halves, down to one
//! row; a single then runs with the device to itself (an exclusive permit); and one that still
//! runs out of memory runs once more on a clean arena — every model's sessions rebuilt, so that
//! nothing earlier failures left behind (a fragmented arena) takes part in the verdict. Only an
//! out-of-memory there fails the task. A call larger than any that ran asks the allocator to give
//! back what it holds when the call ends, so that its failure leaves the arena as it found it:
//! where the allocator can (ONNX Runtime's CPU and CUDA arenas), halving alone finds what fits
//! and a rebuild is rare. The largest size that works is remembered per bucket,
//! probed upwards slowly so a transient OOM does not pin it low forever, and kept (through a
//! [`CeilingStore`]) where a restarted worker of the same kind finds it.
//!
//! Nothing here knows of Kafka: items are anything with prepared inputs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use sluice_schemas::Priority;

use crate::engine::{Call, CallTask, Engine, EngineError, Tensor};
use crate::events::{self, Emit};
use crate::metrics::Metrics;
use crate::models::{Bucket, Prepared, concat_inputs};

use super::joiners::Joiners;
pub use super::joiners::Joining;
use super::steps::{Checkpoints, Progress, Resume, Resumes};

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

    /// Starts at `limit` (a stored ceiling) instead of the maximum; it still probes upwards.
    pub fn starting_at(mut self, limit: usize) -> Ceiling {
        self.limit = limit.clamp(1, self.max);
        self
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How many times longer than at first it waits before the next probe (1: never failed;
    /// doubled by each failed probe, back to 1 when one holds).
    pub fn backoff(&self) -> u32 {
        self.probe_every / self.base_probe_every
    }

    /// Waits `backoff` times longer before its next probe, as after that many failed probes'
    /// doublings (a restarted worker does not repeat at once a probe that failed before).
    pub fn backed_off(mut self, backoff: u32) -> Ceiling {
        self.probe_every = self.base_probe_every.saturating_mul(backoff.clamp(1, MAX_PROBE_BACKOFF));
        self
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

    /// Probes one task higher now, without waiting for clean batches: what the limit was learned
    /// on is gone (the arena was rebuilt). Returns the new limit, if it went up.
    pub fn probe_now(&mut self) -> Option<usize> {
        if self.limit >= self.max || self.probing {
            return None;
        }
        self.limit += 1;
        self.streak = 0;
        self.probing = true;
        Some(self.limit)
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

/// What a bucket learned that is worth keeping across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Learned {
    /// Tasks per call that ran.
    pub limit: usize,
    /// Rows per call for one task of the bucket, when its rows don't fit together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part_rows: Option<usize>,
    /// The wait before the next probe, as a multiple of the first ([`Ceiling::backoff`]): a
    /// probe above `limit` failed that many doublings ago.
    #[serde(default = "no_backoff", skip_serializing_if = "is_no_backoff")]
    pub probe_backoff: u32,
}

fn no_backoff() -> u32 {
    1
}

fn is_no_backoff(b: &u32) -> bool {
    *b <= 1
}

/// Where learned ceilings outlive the process, keyed by bucket (its `Display` form) on this
/// worker's device class. Both calls are cheap and never block on I/O.
pub trait CeilingStore: Send + Sync {
    fn get(&self, bucket: &str) -> Option<Learned>;
    /// Keeps `learned` for `bucket`; `None` forgets it (the bucket is back at its maximum).
    fn put(&self, bucket: &str, learned: Option<Learned>);
}

/// What a rebuild on a clean arena found, bytes of the arena (where it can be read: the shared
/// CPU arena) before the rebuild, after it, and after the first load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cleaned {
    pub before: Option<u64>,
    pub after: Option<u64>,
    pub baseline: Option<u64>,
}

impl Cleaned {
    /// Whether the arena is back near its baseline (within 5 %, at least 1 MiB), or can't be read.
    pub fn is_clean(&self) -> bool {
        match (self.after, self.baseline) {
            (Some(after), Some(baseline)) => after <= baseline + (baseline / 20).max(1 << 20),
            _ => true,
        }
    }
}

/// Gives the device a clean arena: every session rebuilt, nothing of earlier runs left.
pub trait CleanArena: Send + Sync {
    /// An error means the models could not be loaded again; the task is left for another try.
    fn clean(&self) -> BoxFuture<'_, Result<Cleaned, EngineError>>;
}

/// Least time between two clean-arena rebuilds for one bucket, and how many times the last
/// rebuild's duration it must be at least: a rebuild reloads every model (a few seconds for a
/// real one on a GPU, ~0.1 s for the tiny ones here), so at most 1/20 of the device's time goes
/// to rebuilds for any one bucket however many of its tasks run out of memory alone.
pub const CLEAN_EVERY_MIN: Duration = Duration::from_secs(5);
pub const CLEAN_EVERY_FACTOR: u32 = 20;

/// Something that can be batched: its prepared inputs, and how to name it in logs.
pub trait BatchItem: Send + 'static {
    fn prepared(&self) -> &Prepared;
    /// Task id for logs.
    fn id(&self) -> String;
    /// Which delivery of the task this is (its checkpoints are this attempt's).
    fn attempt(&self) -> u32 {
        1
    }
    /// Dimensions for logs and the DLQ.
    fn dimensions(&self) -> String;
    /// Progress and cancellation of the task, for models with many steps.
    fn hooks(&self) -> Option<Arc<dyn crate::engine::TaskHooks>> {
        None
    }
    /// The task's priority lane: its calls take their turn at the device gate by it.
    fn lane(&self) -> Priority {
        Priority::Standard
    }
    /// Where the task's rows stand, when it carries on from a checkpoint.
    fn resume(&self) -> Option<&Resume> {
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
                attempt: i.attempt(),
                rows: i.prepared().rows,
                hooks: i.hooks(),
            })
            .collect(),
    }
}

/// The best of the lanes of `items` (a batch is of one lane).
fn lane_of<T: BatchItem>(items: &[T]) -> Priority {
    items.iter().map(BatchItem::lane).min().unwrap_or_default()
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

/// A bucket's learned state.
struct Entry {
    ceiling: Ceiling,
    /// Rows per call for one task alone, once its rows did not fit together.
    part_rows: Option<usize>,
    /// What the store holds for the bucket.
    stored: Option<Learned>,
    /// The last clean-arena retry: when it ended and whether the task fit.
    last_clean: Option<(Instant, bool)>,
    /// The bucket's next call runs on a freshly rebuilt arena: the probe that follows a clean
    /// retry, or the smaller call after such a probe failed (on the arena it left behind, the
    /// size that fits might not).
    clean_next: bool,
    /// When a probe on a clean arena last failed: no other one follows a clean retry before
    /// the bucket may rebuild again.
    clean_probe_failed: Option<Instant>,
    /// The most tasks of the bucket that ran in one call since the last out-of-memory error of
    /// this size (0: none yet). A larger call may not fit, so it runs with the arena shrunk at
    /// its end: if it fails, it leaves the arena as clean as it found it.
    fits: usize,
    /// Last use, to forget the stalest bucket first.
    used: u64,
}

impl Entry {
    fn learned(&self) -> Option<Learned> {
        (self.ceiling.limit < self.ceiling.max || self.part_rows.is_some()).then_some(Learned {
            limit: self.ceiling.limit,
            part_rows: self.part_rows,
            probe_backoff: self.ceiling.backoff(),
        })
    }
}

/// Runs batches adaptively on the engine.
pub struct Adaptive {
    engine: Engine,
    /// Learned state per bucket, at most [`MAX_CEILINGS`]: the least recently used goes first.
    ceilings: Mutex<HashMap<Bucket, Entry>>,
    /// Uses so far, to order the ceilings by their last use.
    uses: std::sync::atomic::AtomicU64,
    max_batch: usize,
    max_rows: usize,
    probe_after: u32,
    serialize_singles: bool,
    metrics: Metrics,
    store: Option<Arc<dyn CeilingStore>>,
    cleaner: Option<Arc<dyn CleanArena>>,
    /// How long the last clean-arena rebuild took.
    last_rebuild: Mutex<Duration>,
    /// The most steps one call of a step-by-step bucket runs ([`crate::engine::Stepped`]);
    /// `None`: every call runs all of its steps.
    steps_per_call: Option<usize>,
    /// Whether tasks join a running step-by-step batch of their bucket between its calls.
    joins: bool,
    /// Where the tasks of buckets that keep checkpoints keep them.
    checkpoints: Option<Arc<dyn Checkpoints>>,
    /// Cancelled when the worker drains (SIGTERM): from then on such tasks keep their state
    /// after every call, so that the next owner loses no step of what ran.
    draining: CancellationToken,
}

/// A running set of a step-by-step bucket ([`Adaptive::run_running`]): its tasks, where the
/// ones to join it come from, and where each task stands.
struct Running<'a, 'j, T> {
    items: &'a mut Vec<T>,
    /// Tasks of the batch put aside (after an out-of-memory error): they join first.
    pending: &'a mut VecDeque<T>,
    joiners: &'a mut Joiners<'j, T>,
    resumes: &'a mut Resumes,
    /// The most tasks that ran together.
    most: usize,
}

struct Chunk<T> {
    items: Vec<T>,
    /// Run alone on the device (a single retried after an OOM, or a bucket down to one).
    exclusive: bool,
    /// Runs right after a rebuild on a clean arena: an out-of-memory here is a verdict.
    clean: bool,
}

impl<T> Chunk<T> {
    fn of(items: Vec<T>, exclusive: bool) -> Chunk<T> {
        Chunk {
            items,
            exclusive,
            clean: false,
        }
    }
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
            store: None,
            cleaner: None,
            last_rebuild: Mutex::new(Duration::ZERO),
            steps_per_call: None,
            joins: true,
            checkpoints: None,
            draining: CancellationToken::new(),
        }
    }

    /// Keeps the state of checkpointed tasks after every call once `draining` is cancelled.
    pub(crate) fn with_drain(mut self, draining: CancellationToken) -> Adaptive {
        self.draining = draining;
        self
    }

    /// Keeps the resume points of tasks of buckets that ask for checkpoints in `checkpoints`.
    pub(crate) fn with_checkpoints(mut self, checkpoints: Arc<dyn Checkpoints>) -> Adaptive {
        self.checkpoints = Some(checkpoints);
        self
    }

    /// Runs the calls of step-by-step buckets ([`crate::engine::Stepped`]) as calls of at most
    /// `steps` steps (0: all of them at once). Not those of the interactive lane: nothing
    /// outranks them at the device gate, so they have no one to make room for, and each step
    /// taken as a call of its own would wait for another lane's call before it.
    pub fn with_steps_per_call(mut self, steps: usize) -> Adaptive {
        self.steps_per_call = (steps > 0).then_some(steps);
        self
    }

    /// Whether tasks join a running batch of their bucket between its calls (on by default).
    /// Off, a step-by-step batch still takes its turn at the device call by call, but its rows
    /// start together and no task joins it.
    pub fn with_joins(mut self, joins: bool) -> Adaptive {
        self.joins = joins;
        self
    }

    /// Keeps learned ceilings in `store` and starts each bucket from what it holds.
    pub fn with_store(mut self, store: Arc<dyn CeilingStore>) -> Adaptive {
        self.store = Some(store);
        self
    }

    /// Gives a task that runs out of memory alone one more run on a clean arena from `cleaner`
    /// before it fails. Without one, the exclusive run's out-of-memory is the verdict.
    pub fn with_cleaner(mut self, cleaner: Arc<dyn CleanArena>) -> Adaptive {
        self.cleaner = Some(cleaner);
        self
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
        self.with_entry(bucket, |e| e.ceiling.limit())
    }

    /// Runs `f` on the state of `bucket` (a crash suspect's is its shape's), made on first use
    /// from what the store holds (and reported).
    fn with_entry<R>(&self, bucket: &Bucket, f: impl FnOnce(&mut Entry) -> R) -> R {
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
            if let Some(stalest) = ceilings.iter().min_by_key(|(_, e)| e.used).map(|(b, _)| b.clone()) {
                ceilings.remove(&stalest);
            }
        }
        let entry = ceilings.entry(bucket.clone()).or_insert_with(|| {
            let stored = self.store.as_ref().and_then(|s| s.get(&bucket.to_string()));
            let mut ceiling = Ceiling::new(self.max_for(bucket), self.probe_after);
            if let Some(learned) = stored {
                ceiling = ceiling.starting_at(learned.limit).backed_off(learned.probe_backoff);
            }
            events::CeilingIs {
                label: &bucket.label(),
                limit: ceiling.limit(),
            }
            .emit(&self.metrics);
            Entry {
                ceiling,
                part_rows: stored.and_then(|l| l.part_rows).filter(|&r| r >= 1),
                stored,
                last_clean: None,
                clean_next: false,
                clean_probe_failed: None,
                fits: 0,
                used: now,
            }
        });
        entry.used = now;
        f(entry)
    }

    /// Changes the state of `bucket` through `f`, reports its limit, and keeps what it learned
    /// in the store (not a probe's raise until a full batch proved it).
    fn update<R>(&self, bucket: &Bucket, f: impl FnOnce(&mut Entry) -> R) -> R {
        self.with_entry(bucket, |e| {
            let r = f(e);
            events::CeilingIs {
                label: &bucket.label(),
                limit: e.ceiling.limit(),
            }
            .emit(&self.metrics);
            let learned = e.learned();
            if let Some(store) = self.store.as_ref().filter(|_| !e.ceiling.probing && learned != e.stored) {
                store.put(&bucket.to_string(), learned);
                e.stored = learned;
            }
            r
        })
    }

    /// Rows per call of a task of `bucket` that runs alone.
    fn part_rows(&self, bucket: &Bucket) -> usize {
        self.with_entry(bucket, |e| e.part_rows).unwrap_or(self.max_rows).min(self.max_rows)
    }

    /// One model call at its turn at the device; one that returned outputs is timed from the
    /// turn to the reply (`sluice_worker_model_call_seconds`). Returns when the turn came.
    async fn device_call(
        &self,
        model: &str,
        call: Call,
        exclusive: bool,
        turn: crate::engine::Turn,
    ) -> Result<(Vec<Tensor>, Instant), EngineError> {
        let result = self.engine.run_timed(model, call, exclusive, turn).await;
        if let Ok((_, granted)) = &result {
            events::ModelCalled {
                model,
                elapsed: granted.elapsed(),
            }
            .emit(&self.metrics);
        }
        result
    }

    /// Runs `items` as one model call; or, one task with more rows than a call may take (the row
    /// cap, or the parts its bucket learned to cut it in), as consecutive calls of at most that
    /// many rows whose outputs are joined, so that the size of a request never sets the size of
    /// a call. An error in any part is the task's.
    /// `had` counts the calls the batch has run, this one's parts included: each takes its turn
    /// at the device gate with it. Also returns when the first part's turn came.
    async fn call<T: BatchItem>(
        &self,
        bucket: &Bucket,
        items: &[T],
        exclusive: bool,
        had: &mut u32,
        resumes: &mut Resumes,
    ) -> Result<(Vec<Tensor>, Instant), EngineError> {
        let call = call_of(bucket, items);
        let lane = lane_of(items);
        let mut turn = || {
            let turn = crate::engine::Turn { lane, had: *had };
            *had += 1;
            turn
        };
        let rows: usize = call.tasks.iter().map(|t| t.rows).sum();
        let part_rows = self.part_rows(bucket);
        if call.tasks.len() != 1 || rows <= part_rows || !by_rows(&call) {
            return self.run_steps(bucket, call, exclusive, (lane, &mut turn), resumes).await;
        }
        let task = &call.tasks[0];
        tracing::debug!(task_id = %task.id, rows, part_rows, "running the task in parts");
        let mut parts: Vec<Vec<Tensor>> = Vec::new();
        let mut first = None;
        for start in (0..rows).step_by(part_rows) {
            let end = (start + part_rows).min(rows);
            let part = Call {
                key: call.key.clone(),
                inputs: call.inputs.iter().map(|t| t.slice_rows(start, end)).collect(),
                tasks: vec![CallTask {
                    rows: end - start,
                    ..task.clone()
                }],
            };
            // A part's state is not its task's: a part that fails is run again whole.
            let (outputs, granted) = self
                .run_steps(bucket, part, exclusive, (lane, &mut turn), &mut Resumes::new())
                .await?;
            first.get_or_insert(granted);
            parts.push(outputs);
        }
        let outputs = parts[0].len();
        if let Some(odd) = parts.iter().find(|p| p.len() != outputs) {
            return Err(EngineError::Run(format!(
                "the model gave {} outputs for one part of a task and {outputs} for another",
                odd.len()
            )));
        }
        let joined = (0..outputs)
            .map(|i| Tensor::concat(&parts.iter().map(|p| &p[i]).collect::<Vec<_>>()))
            .collect();
        Ok((joined, first.expect("at least one part")))
    }

    /// Runs `call` on the engine: in one go, or, for a bucket whose model runs its rows step by
    /// step and whose steps are more than a call may run, as consecutive calls of at most
    /// `steps_per_call` steps. Each carries the rows' state (the key's `carry` outputs) into the
    /// next and takes its own turn at the device gate, so another bucket's call waits for a few
    /// steps of this one, not for all of them. The last call's outputs are the call's. Also
    /// returns when the first call's turn came.
    ///
    /// A task of `resumes` carries on from its resume point. When a call fails after others
    /// moved the rows on, each task's point before it goes into `resumes`: run again in a smaller
    /// batch (after an out-of-memory error), it does not start over. A task that ran to its end
    /// leaves `resumes`.
    async fn run_steps(
        &self,
        bucket: &Bucket,
        call: Call,
        exclusive: bool,
        (lane, turn): (Priority, &mut impl FnMut() -> crate::engine::Turn),
        resumes: &mut Resumes,
    ) -> Result<(Vec<Tensor>, Instant), EngineError> {
        let (Some(per_call), Some(stepped)) = (self.steps_per_call, call.key.steps().cloned()) else {
            return self.device_call(&bucket.model, call, exclusive, turn()).await;
        };
        // The interactive lane's: all their steps in one call (from where their rows stand).
        let per_call = if lane == Priority::Interactive {
            stepped.steps.len()
        } else {
            per_call
        };
        let mut progress = Progress::start(&call, &stepped, resumes);
        if progress.in_one_call(per_call) {
            return self.device_call(&bucket.model, call, exclusive, turn()).await;
        }
        let mut first = None;
        loop {
            let steps = progress.next_call(&call, per_call);
            let (outputs, granted) = match self.device_call(&bucket.model, steps, exclusive, turn()).await {
                Ok(done) => done,
                Err(error) => {
                    progress.keep(&call, resumes);
                    return Err(error);
                }
            };
            let first = *first.get_or_insert(granted);
            progress.advance(&outputs, per_call);
            self.save_due(bucket, &stepped, &mut progress, &call);
            if progress.done() {
                for task in &call.tasks {
                    resumes.remove(&task.id);
                }
                return Ok((outputs, first));
            }
        }
    }

    /// Whether `chunk` runs as a running set that tasks join and leave at step boundaries: its
    /// bucket runs step by step, a call at a time ([`Adaptive::with_steps_per_call`]), not in
    /// the interactive lane, and the chunk is none of the special runs (alone on the device, on a clean arena, a crash
    /// suspect, one task cut in parts).
    fn joinable<T: BatchItem>(&self, bucket: &Bucket, chunk: &Chunk<T>) -> bool {
        let rows: usize = chunk.items.iter().map(|i| i.prepared().rows).sum();
        self.takes_joins(lane_of(&chunk.items), bucket) && !chunk.exclusive && !chunk.clean && rows <= self.part_rows(bucket)
    }

    /// Runs the running set `set` one call of [`Adaptive::with_steps_per_call`] steps at a
    /// time. Before each call, tasks from `set.pending` (put aside after an out-of-memory
    /// error), then from `set.joiners` (asked for at the boundary before and prepared while the
    /// call ran: [`Joiners`]), join it at their first step (or their resume point), as
    /// many as the bucket's limit has room for; after it, the tasks whose steps ended (or that
    /// were cancelled) leave the set and are reported through `on_done`. Each call takes its own
    /// turn at the device gate. Returns the last call's outputs, for the tasks left in `set.items`
    /// (all of which ended in it), and when the first of them started.
    ///
    /// On an error, `set.items` are the tasks that were running, each with its resume point
    /// (the state before the failed call) in `set.resumes`: run again in a smaller set, none
    /// starts over.
    async fn run_running<T: BatchItem>(
        &self,
        bucket: &Bucket,
        set: &mut Running<'_, '_, T>,
        had: &mut u32,
        on_done: &mut impl FnMut(Done<T>),
    ) -> Result<(Vec<Tensor>, Instant), EngineError> {
        let per_call = self.steps_per_call.expect("a joinable chunk");
        let stepped = bucket.key.steps().cloned().expect("a joinable chunk");
        let lane = lane_of(set.items);
        let mut progress = Progress::start(&call_of(bucket, set.items), &stepped, set.resumes);
        let mut started: HashMap<String, Instant> = HashMap::new();
        let mut calls_of: HashMap<String, u32> = HashMap::new();
        loop {
            // Joining before each call, the first too: the batcher keeps the tasks that arrive
            // for this batch from the moment it says it has room.
            self.join_waiting(bucket, set, &mut progress);
            let call = call_of(bucket, set.items);
            let turn = crate::engine::Turn {
                lane,
                had: newest_turns(&call, &mut calls_of),
            };
            *had += 1;
            let (outputs, granted) = match set
                .joiners
                .during(self.device_call(&bucket.model, progress.next_call(&call, per_call), false, turn))
                .await
            {
                Ok(done) => done,
                Err(error) => {
                    progress.keep(&call, set.resumes);
                    return Err(error);
                }
            };
            for task in &call.tasks {
                started.entry(task.id.clone()).or_insert(granted);
            }
            progress.advance(&outputs, per_call);
            self.save_due(bucket, &stepped, &mut progress, &call);
            let since = |id: &str| started.get(id).copied().unwrap_or(granted);
            let ended = progress.finished(&call, &outputs);
            if ended.iter().all(|&e| e) {
                for task in &call.tasks {
                    set.resumes.remove(&task.id);
                }
                let first = call.tasks.iter().map(|t| since(&t.id)).min().unwrap_or(granted);
                return Ok((outputs, first));
            }
            if !ended.iter().any(|&e| e) {
                continue;
            }
            // The tasks that ended leave: each reported on its own, with its rows of the outputs.
            let mut staying = Vec::with_capacity(set.items.len());
            for ((item, (task, rows)), &ended) in std::mem::take(set.items).into_iter().zip(call.task_rows()).zip(&ended) {
                if !ended {
                    staying.push(item);
                    continue;
                }
                set.resumes.remove(&task.id);
                on_done(Done::Ran {
                    items: vec![item],
                    outputs: Arc::new(outputs.iter().map(|t| t.slice_rows(rows.start, rows.end)).collect()),
                    elapsed: since(&task.id).elapsed(),
                    batch_size: call.tasks.len(),
                });
            }
            progress.retain(&call, &ended.iter().map(|e| !e).collect::<Vec<_>>());
            *set.items = staying;
        }
    }

    /// The tasks waiting to join `set` (put aside ones first, then joiners ready now), as many as
    /// the bucket's limit has room for, added to it and to `progress` at their first step or
    /// their resume point.
    fn join_waiting<T: BatchItem>(&self, bucket: &Bucket, set: &mut Running<'_, '_, T>, progress: &mut Progress<'_>) {
        let room = self.limit(bucket).saturating_sub(set.items.len());
        let mut joined: Vec<T> = set.pending.drain(..room.min(set.pending.len())).collect();
        joined.extend(set.joiners.ready(room - joined.len()));
        if joined.is_empty() {
            return;
        }
        for item in &joined {
            if let Some(resume) = item.resume() {
                set.resumes.entry(item.id()).or_insert_with(|| resume.clone());
            }
            progress.join(item.prepared().rows, set.resumes.get(&item.id()));
        }
        let task_ids: Vec<String> = joined.iter().map(BatchItem::id).collect();
        set.items.extend(joined);
        events::Joined {
            bucket: &bucket.name(),
            task_ids: &task_ids,
            running: set.items.len(),
        }
        .emit(&self.metrics);
        if set.items.len() > set.most && self.with_entry(bucket, |e| set.items.len() > e.fits) {
            // As in `run`: a size that may not fit gives back what it allocates.
            self.engine.release_memory(&bucket.model);
        }
        set.most = set.most.max(set.items.len());
    }

    /// Saves the resume points of the tasks of `call` due a checkpoint after a call, for a
    /// bucket that keeps them: every `checkpoint_every` steps or `checkpoint_seconds`, and after
    /// every step once the worker drains.
    fn save_due(&self, bucket: &Bucket, stepped: &crate::engine::Stepped, progress: &mut Progress<'_>, call: &Call) {
        if let (true, Some(sink)) = (stepped.keeps_checkpoints(), &self.checkpoints) {
            for (task, resume) in progress.due(call, self.draining.is_cancelled()) {
                sink.save(task, bucket, resume);
            }
        }
    }

    /// Whether batches of `bucket` in `lane` run as running sets that tasks join: the bucket runs
    /// step by step, a call at a time, it is no crash suspect's, and the lane is not the
    /// interactive one (which runs all its steps in one call).
    fn takes_joins(&self, lane: Priority, bucket: &Bucket) -> bool {
        self.joins
            && self.steps_per_call.is_some()
            && bucket.key.steps().is_some()
            && bucket.alone.is_none()
            && lane != Priority::Interactive
    }

    /// Rows the largest call of `items` (one chunk) holds, and whether they could be cut into
    /// smaller parts.
    fn call_rows<T: BatchItem>(&self, bucket: &Bucket, items: &[T]) -> (usize, bool) {
        let rows: usize = items.iter().map(|i| i.prepared().rows).sum();
        if items.len() != 1 {
            return (rows, false);
        }
        let splittable = by_rows(&call_of(bucket, items));
        if splittable {
            (rows.min(self.part_rows(bucket)), true)
        } else {
            (rows, false)
        }
    }

    /// Least time between two clean-arena rebuilds of one bucket: [`CLEAN_EVERY_FACTOR`] times
    /// the last rebuild's duration, at least [`CLEAN_EVERY_MIN`].
    fn clean_every(&self) -> Duration {
        (*self.last_rebuild.lock().expect("last rebuild") * CLEAN_EVERY_FACTOR).max(CLEAN_EVERY_MIN)
    }

    /// Rebuilds every session on a clean arena before `items` of `bucket` run; `Err` if the
    /// models could not be loaded again (the worker stops: the items are not at fault).
    async fn rebuild<T: BatchItem>(&self, bucket: &Bucket, items: &[T]) -> Result<(), ()> {
        let Some(cleaner) = &self.cleaner else { return Err(()) };
        let started = Instant::now();
        match cleaner.clean().await {
            Ok(cleaned) => {
                *self.last_rebuild.lock().expect("last rebuild") = started.elapsed();
                let (task_ids, dimensions) = names(items);
                events::ArenaCleaned {
                    bucket: &bucket.name(),
                    task_ids: &task_ids,
                    dimensions: &dimensions,
                    arena_before: cleaned.before,
                    arena_after: cleaned.after,
                    arena_baseline: cleaned.baseline,
                    clean: cleaned.is_clean(),
                    elapsed: started.elapsed(),
                }
                .emit(&self.metrics);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "rebuilding the sessions on a clean arena failed");
                Err(())
            }
        }
    }

    /// Whether `bucket` may rebuild on a clean arena now: `Ok(())`, `Err(Some(wait))` if its
    /// last rebuild (which fit) was too recent, `Err(None)` if its last one was a verdict that
    /// still holds.
    fn may_clean(&self, bucket: &Bucket) -> Result<(), Option<Duration>> {
        let every = self.clean_every();
        match self.with_entry(bucket, |e| e.last_clean) {
            Some((at, fit)) if at.elapsed() < every => Err(fit.then(|| every - at.elapsed())),
            _ => Ok(()),
        }
    }

    /// Runs `items` (all of `bucket`) and reports each chunk as it finishes, so that CPU work on
    /// its results overlaps the next chunk's inference.
    pub async fn run<T: BatchItem>(&self, bucket: &Bucket, items: Vec<T>, on_done: impl FnMut(Done<T>)) {
        self.run_joined(bucket, items, None, on_done).await;
    }

    /// [`Adaptive::run`], and with `joining`, for a bucket run step by step
    /// ([`Adaptive::with_steps_per_call`]), as a running set: at each step boundary the tasks
    /// whose steps ended leave it (reported at once, so that their images are stored while the
    /// others go on) and tasks that arrived since join it, up to the bucket's limit.
    pub async fn run_joined<T: BatchItem>(
        &self,
        bucket: &Bucket,
        items: Vec<T>,
        mut joining: Option<&mut dyn Joining<T>>,
        mut on_done: impl FnMut(Done<T>),
    ) {
        let mut pending: VecDeque<T> = items.into();
        // Chunks to run before taking new ones from `pending`: halves of a chunk whose model error
        // is being isolated, or a single retried alone after an OOM.
        let mut retries: VecDeque<Chunk<T>> = VecDeque::new();
        let mut had = 0;
        // Where tasks stand: from their checkpoints, and after a call that failed part way.
        let mut resumes: Resumes = pending
            .iter()
            .filter_map(|item| Some((item.id(), item.resume()?.clone())))
            .collect();
        while let Some(chunk) = retries.pop_front().or_else(|| self.next_chunk(bucket, &mut pending)) {
            let Some(mut chunk) = self.clean_if_due(bucket, chunk, &mut on_done).await else {
                continue;
            };
            let mut size = chunk.items.len();
            if self.with_entry(bucket, |e| size > e.fits) {
                // This size may not fit: whatever it allocates goes back to the system when it
                // ends, so that a failure leaves no pieces for the smaller call after it.
                self.engine.release_memory(&bucket.model);
            }
            let asked = Instant::now();
            // A running set's joiners: those prepared and not joined when it stops run next.
            let mut joiners = None;
            let result = match joining.as_deref_mut() {
                Some(joining) if self.joinable(bucket, &chunk) => {
                    let mut set = Running {
                        items: &mut chunk.items,
                        pending: &mut pending,
                        joiners: joiners.insert(Joiners::new(joining)),
                        resumes: &mut resumes,
                        most: size,
                    };
                    let result = self.run_running(bucket, &mut set, &mut had, &mut on_done).await;
                    // What it learns of: the most tasks that ran together; after a failure, the
                    // tasks that were running.
                    size = if result.is_ok() { set.most } else { chunk.items.len() };
                    result
                }
                joining => {
                    let lane = lane_of(&chunk.items);
                    if let Some(joining) = joining.filter(|_| self.takes_joins(lane, bucket)) {
                        // None joins this one (it runs alone, or on a clean arena, or in parts):
                        // what the batcher keeps for the batch goes out on its own.
                        joining.more(0).await;
                    }
                    self.call(bucket, &chunk.items, chunk.exclusive, &mut had, &mut resumes).await
                }
            };
            // From its turn at the device (the wait for it left out) to its end.
            let elapsed = match &result {
                Ok((_, granted)) => granted.elapsed(),
                Err(_) => asked.elapsed(),
            };
            match result.map(|(outputs, _)| outputs) {
                Ok(outputs) => {
                    self.learn_from_success(bucket, size, chunk.clean, elapsed);
                    on_done(Done::Ran {
                        items: chunk.items,
                        outputs: Arc::new(outputs),
                        elapsed,
                        batch_size: size,
                    });
                }
                Err(error) if error.is_oom() => {
                    if let Some(retry) = self.on_oom(bucket, chunk, error, &mut pending, &mut on_done).await {
                        retries.push_front(retry);
                    }
                }
                Err(error) if error.is_task_error() && size > 1 => {
                    // A model error or panic inside a batch: isolate it by bisection so the
                    // others run.
                    events::Bisected {
                        bucket: &bucket.name(),
                        size,
                        error: &error,
                    }
                    .emit(&self.metrics);
                    let mut items = chunk.items;
                    let second = items.split_off(size / 2);
                    retries.push_front(Chunk::of(second, chunk.exclusive));
                    retries.push_front(Chunk::of(items, chunk.exclusive));
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
            // After the set's last tasks are reported: a joiner may be waiting on their end.
            if let Some(mut joiners) = joiners {
                pending.extend(joiners.settle().await);
            }
        }
    }

    /// The next call's tasks from `pending`: as many as the bucket's limit.
    fn next_chunk<T: BatchItem>(&self, bucket: &Bucket, pending: &mut VecDeque<T>) -> Option<Chunk<T>> {
        if pending.is_empty() {
            return None;
        }
        let n = self.limit(bucket).min(pending.len());
        let items: Vec<T> = pending.drain(..n).collect();
        // A bucket down to one serializes its device work.
        let exclusive = n == 1 && self.serialize_singles && self.limit(bucket) == 1;
        Some(Chunk::of(items, exclusive))
    }

    /// Rebuilds the model's sessions first when the bucket asked for a clean arena before its
    /// next call. `None` when the rebuild failed: the chunk's tasks have failed with it.
    async fn clean_if_due<T: BatchItem>(
        &self,
        bucket: &Bucket,
        mut chunk: Chunk<T>,
        on_done: &mut impl FnMut(Done<T>),
    ) -> Option<Chunk<T>> {
        if chunk.clean || !self.with_entry(bucket, |e| std::mem::take(&mut e.clean_next)) {
            return Some(chunk);
        }
        match self.rebuild(bucket, &chunk.items).await {
            Ok(()) => {
                chunk.clean = true;
                Some(chunk)
            }
            Err(()) => {
                for item in chunk.items {
                    on_done(Done::Failed {
                        item,
                        error: EngineError::Stopped,
                    });
                }
                None
            }
        }
    }

    /// What a call of `size` that fitted teaches: the size fits, and the ceiling may be probed.
    /// A single that fitted on a clean arena probes above the ceiling at once (the ceiling was
    /// learned on the arena that is gone), unless such a probe failed a moment ago.
    fn learn_from_success(&self, bucket: &Bucket, size: usize, clean: bool, elapsed: Duration) {
        let name = bucket.name();
        events::BatchRan {
            bucket: &name,
            size,
            elapsed,
        }
        .emit(&self.metrics);
        // A single that fitted on a clean arena: how soon a failed clean probe may be repeated.
        let clean_single = (clean && size == 1).then(|| {
            events::CleanRetryEnded { bucket: &name, fit: true }.emit(&self.metrics);
            self.clean_every()
        });
        let probe = self.update(bucket, |e| {
            e.fits = e.fits.max(size);
            let Some(every) = clean_single else {
                return e.ceiling.on_success(size);
            };
            e.last_clean = Some((Instant::now(), true));
            if e.clean_probe_failed.is_some_and(|at| at.elapsed() < every) {
                return None;
            }
            let to = e.ceiling.probe_now();
            e.clean_next = to.is_some();
            to
        });
        if let Some(to) = probe {
            events::CeilingProbed { bucket: &name, to }.emit(&self.metrics);
        }
    }

    /// What follows an out-of-memory of `chunk`, in order: fewer tasks per call; one task's rows
    /// in smaller parts; the single alone with the device to itself; the single once more on a
    /// clean arena; and only then a failed task. Returns the chunk to run next, if any (fewer
    /// tasks go back to `pending`).
    async fn on_oom<T: BatchItem>(
        &self,
        bucket: &Bucket,
        chunk: Chunk<T>,
        error: EngineError,
        pending: &mut VecDeque<T>,
        on_done: &mut impl FnMut(Done<T>),
    ) -> Option<Chunk<T>> {
        // A call of a size that ran before may have failed on an arena in pieces: the next run
        // gives back what they hold when it ends. (A call of a size not known to fit already
        // shrank the arena as it failed.)
        self.engine.release_memory(&bucket.model);
        let size = chunk.items.len();
        self.with_entry(bucket, |e| e.fits = e.fits.min(size.saturating_sub(1)));
        if size > 1 {
            self.fewer_tasks(bucket, chunk, &error, pending);
            return None;
        }
        let (rows, splittable) = self.call_rows(bucket, &chunk.items);
        if splittable && rows > 1 {
            self.smaller_parts(bucket, &chunk, rows, &error);
            return Some(chunk);
        }
        self.update(bucket, |e| e.ceiling.on_oom(1));
        if !chunk.exclusive && self.serialize_singles {
            // Alone but beside other runs: try once more with the device to itself.
            let (task_ids, dimensions) = names(&chunk.items);
            events::OomHandled {
                bucket: &bucket.name(),
                from: 1,
                to: 1,
                task_ids,
                dimensions,
                error: &error,
            }
            .emit(&self.metrics);
            return Some(Chunk { exclusive: true, ..chunk });
        }
        self.single_out_of_memory(bucket, chunk, rows, error, on_done).await
    }

    /// Fewer tasks per call: the bucket's ceiling comes down and the same tasks go back to
    /// `pending`, to run at the new size.
    fn fewer_tasks<T: BatchItem>(&self, bucket: &Bucket, chunk: Chunk<T>, error: &EngineError, pending: &mut VecDeque<T>) {
        let size = chunk.items.len();
        let (task_ids, dimensions) = names(&chunk.items);
        let to = self.update(bucket, |e| {
            if chunk.clean {
                // A probe on a clean arena failed: the smaller call gets a clean one too.
                e.clean_probe_failed = Some(Instant::now());
                e.clean_next = true;
            }
            // A failed probe ran with the arena shrunk at its end (it was larger than
            // anything that ran): the size below it finds the arena as before the probe.
            e.ceiling.on_oom(size)
        });
        events::OomHandled {
            bucket: &bucket.name(),
            from: size,
            to,
            task_ids,
            dimensions,
            error,
        }
        .emit(&self.metrics);
        for item in chunk.items.into_iter().rev() {
            pending.push_front(item);
        }
    }

    /// One task whose `rows` did not fit together: they run in halves from now on.
    fn smaller_parts<T: BatchItem>(&self, bucket: &Bucket, chunk: &Chunk<T>, rows: usize, error: &EngineError) {
        let to = rows / 2;
        self.update(bucket, |e| {
            e.ceiling.on_oom(1);
            e.part_rows = Some(to);
        });
        let (task_ids, dimensions) = names(&chunk.items);
        events::RowsHalved {
            bucket: &bucket.name(),
            task_id: &task_ids[0],
            dimensions: &dimensions[0],
            from: rows,
            to,
            error,
        }
        .emit(&self.metrics);
    }

    /// A single, alone with the device to itself, out of memory: once more on a clean arena
    /// (the chunk to run next), or a verdict — it does not fit, and fails.
    async fn single_out_of_memory<T: BatchItem>(
        &self,
        bucket: &Bucket,
        chunk: Chunk<T>,
        rows: usize,
        error: EngineError,
        on_done: &mut impl FnMut(Done<T>),
    ) -> Option<Chunk<T>> {
        let verdict = match (&self.cleaner, chunk.clean) {
            (_, true) => {
                self.update(bucket, |e| e.last_clean = Some((Instant::now(), false)));
                events::CleanRetryEnded {
                    bucket: &bucket.name(),
                    fit: false,
                }
                .emit(&self.metrics);
                "out of memory on a clean arena"
            }
            (None, false) => "out of memory alone with the device to itself",
            (Some(_), false) => match self.may_clean(bucket) {
                Err(None) => "a task of the same shape ran out of memory on a clean arena a moment ago",
                wait => {
                    if let Err(Some(wait)) = wait {
                        tokio::time::sleep(wait).await;
                    }
                    if self.rebuild(bucket, &chunk.items).await.is_ok() {
                        return Some(Chunk {
                            exclusive: true,
                            clean: true,
                            ..chunk
                        });
                    }
                    // The models could not be loaded again: not the task's fault.
                    for item in chunk.items {
                        on_done(Done::Failed {
                            item,
                            error: EngineError::Stopped,
                        });
                    }
                    return None;
                }
            },
        };
        let (task_ids, dimensions) = names(&chunk.items);
        events::DoesNotFit {
            bucket: &bucket.name(),
            task_id: &task_ids[0],
            dimensions: &dimensions[0],
            rows,
            verdict,
            error: &error,
        }
        .emit(&self.metrics);
        let item = chunk.items.into_iter().next().expect("one item");
        on_done(Done::Failed { item, error });
        None
    }
}

/// Whether every input of `call` is one row per task row, so it can be cut into parts.
fn by_rows(call: &Call) -> bool {
    let rows: usize = call.tasks.iter().map(|t| t.rows).sum();
    call.inputs.iter().all(|t| t.shape.first() == Some(&rows))
}

impl crate::batching::batcher::BatchLimits for Adaptive {
    fn limit(&self, bucket: &Bucket) -> usize {
        Adaptive::limit(self, bucket)
    }

    fn takes_joins(&self, lane: Priority, bucket: &Bucket) -> bool {
        self.takes_joins(lane, bucket)
    }
}

/// The turns a running set's call claims: those of its newest task (the fewest calls any of its
/// tasks has had), each task's count of calls then taken up by one. Counted per task, not per
/// set: a set that tasks keep joining would otherwise rank behind every newer batch of another
/// bucket for ever, and run only once overtaken `MAX_OVERTAKEN` times (`engine/turns.rs`).
fn newest_turns(call: &Call, calls_of: &mut HashMap<String, u32>) -> u32 {
    calls_of.retain(|id, _| call.tasks.iter().any(|t| &t.id == id));
    let newest = call
        .tasks
        .iter()
        .map(|t| calls_of.get(&t.id).copied().unwrap_or(0))
        .min()
        .unwrap_or(0);
    for task in &call.tasks {
        *calls_of.entry(task.id.clone()).or_insert(0) += 1;
    }
    newest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{CallKey, Stepped};
    use crate::models::ModelAdapter;
    use crate::testing::fake::{Device, ERROR_SEED, FakeModel, PANIC_SEED, prepared, prepared_whole};

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
            key: CallKey::none(),
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

    /// Runs one task of ten rows (row r holds r) alone and returns the outputs of each call that
    /// ran; the task must not fail.
    async fn run_ten_rows(a: &Adaptive) -> Vec<Arc<Vec<Tensor>>> {
        let mut task = prepared(3, 10);
        task.inputs[0] = Tensor::f32("x", vec![10, 1], (0..10).map(|r| r as f32).collect());
        let mut outputs = Vec::new();
        a.run(&bucket(10), vec![Item(task, "big".into())], |done| match done {
            Done::Ran { outputs: o, .. } => outputs.push(o),
            Done::Failed { error, .. } => panic!("{error}"),
        })
        .await;
        outputs
    }

    #[tokio::test]
    async fn an_oom_halves_the_batch_runs_the_same_tasks_and_remembers_the_size() {
        let (a, device, metrics) = adaptive(4, 1, 8, 16, true).await;
        let (sizes, ran, failed) = run(&a, &bucket(1), items(0..8, 1)).await;
        assert_eq!(sizes, vec![4, 4]);
        assert_eq!(ran.len(), 8);
        assert!(failed.is_empty());
        assert_eq!(a.limit(&bucket(1)), 4, "learned");
        assert_eq!(metrics.ooms(&bucket(1).label()), 1);
        assert!(device.peak.load(std::sync::atomic::Ordering::SeqCst) <= 4);
        // The next batch starts at the learned size: no OOM.
        let (sizes, _, _) = run(&a, &bucket(1), items(10..16, 1)).await;
        assert_eq!(sizes, vec![4, 2]);
        assert_eq!(metrics.ooms(&bucket(1).label()), 1);
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
        let outputs = run_ten_rows(&a).await;
        let y = &outputs[0][0];
        assert_eq!(y.shape, vec![10, 1]);
        let want: Vec<f32> = (0..10).map(|r| 2.0 * r as f32).collect();
        assert_eq!(y.f32_rows(0, 10).unwrap(), want.as_slice());
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 3, "4 + 4 + 2 rows");
        assert!(device.peak.load(std::sync::atomic::Ordering::SeqCst) <= 4);
    }

    /// A bucket of one-row tasks whose model runs steps `0..steps` step by step (the fake's `y`
    /// counts them, carried on as `y_before`).
    fn stepped_bucket(steps: usize, checkpoint_every: Option<usize>) -> Bucket {
        let stepped = Stepped {
            steps: 0..steps,
            carry: &[("y", "y_before")],
            checkpoint_every,
            checkpoint_seconds: None,
        };
        Bucket {
            key: CallKey::new("stepped", None).stepped(stepped),
            ..bucket(1)
        }
    }

    /// Runs `items` as one batch that must not fail: the outputs of each call that ran.
    async fn outputs_of(a: &Adaptive, b: &Bucket, items: Vec<Item>) -> Vec<Arc<Vec<Tensor>>> {
        let mut outputs = Vec::new();
        a.run(b, items, |done| match done {
            Done::Ran { outputs: o, .. } => outputs.push(o),
            Done::Failed { error, .. } => panic!("{error}"),
        })
        .await;
        outputs
    }

    /// A bucket whose model runs step by step runs as calls of at most `steps_per_call` steps,
    /// each taking the rows' state from the one before: five steps two a call are steps 0..2,
    /// 2..4 and 4..5, and the batch's outputs are the last call's, five steps on.
    #[tokio::test]
    async fn a_step_by_step_batch_runs_a_few_steps_a_call_and_carries_its_rows_on() {
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(2);
        let b = stepped_bucket(5, None);
        let outputs = outputs_of(&a, &b, items([1, 2], 1)).await;
        assert_eq!(*device.steps.lock().unwrap(), vec![0..2, 2..4, 4..5]);
        assert_eq!(outputs.len(), 1, "one batch");
        assert_eq!(outputs[0][0].f32_rows(0, 2).unwrap(), [5.0, 5.0]);
        // Without a limit, one call runs every step.
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        run(&a, &b, items([1, 2], 1)).await;
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(device.steps.lock().unwrap().is_empty());
    }

    /// An out-of-memory error at a later step halves the batch, and each half carries on from
    /// the step its rows reached: nothing starts over. Two tasks run steps 0..2 together; more
    /// than one row from step 2 on does not fit; each task then runs 2..4 and 4..6 alone, and
    /// counts six steps.
    #[tokio::test]
    async fn an_out_of_memory_error_at_a_later_step_halves_the_batch_and_keeps_the_rows_steps() {
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        device.oom_from_step.store(2, std::sync::atomic::Ordering::SeqCst);
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(2);
        let outputs = outputs_of(&a, &stepped_bucket(6, None), items([1, 2], 1)).await;
        let ranges = device.steps.lock().unwrap().clone();
        assert_eq!(ranges, vec![0..2, 2..4, 4..6, 2..4, 4..6], "the failed call is not recorded");
        assert_eq!(outputs.len(), 2, "one task a call after the halving");
        for o in &outputs {
            assert_eq!(o[0].f32_rows(0, 1).unwrap(), [6.0]);
        }
    }

    /// The checkpoints saved: each task's id and step.
    struct KeptSteps(Mutex<Vec<(String, usize)>>);

    impl Checkpoints for KeptSteps {
        fn save(&self, task: &CallTask, _: &Bucket, resume: Resume) {
            self.0.lock().unwrap().push((task.id.clone(), resume.step));
        }
    }

    impl KeptSteps {
        /// The steps kept, of task `id` or of every task.
        fn steps(&self, id: Option<&str>) -> Vec<usize> {
            let kept = self.0.lock().unwrap();
            kept.iter().filter(|(t, _)| id.is_none_or(|id| t == id)).map(|(_, s)| *s).collect()
        }
    }

    /// An adaptive batcher that runs a step a call and keeps its checkpoints in a [`KeptSteps`].
    async fn checkpointing() -> (Adaptive, Arc<KeptSteps>) {
        let (a, _, _) = adaptive(64, 1, 8, 16, true).await;
        let kept = Arc::new(KeptSteps(Mutex::new(Vec::new())));
        let a = Arc::into_inner(a)
            .expect("one owner")
            .with_steps_per_call(1)
            .with_checkpoints(kept.clone());
        (a, kept)
    }

    /// The steps each task's state is kept at: every `checkpoint_every` steps before the last,
    /// and, once the worker drains, after every step.
    #[tokio::test]
    async fn checkpoints_fall_every_n_steps_and_after_every_step_of_a_drain() {
        let b = stepped_bucket(7, Some(3));
        for draining in [false, true] {
            let (a, kept) = checkpointing().await;
            let drain = CancellationToken::new();
            let a = a.with_drain(drain.clone());
            if draining {
                drain.cancel();
            }
            run(&a, &b, items([1], 1)).await;
            let steps = kept.steps(None);
            let want = if draining { vec![1, 2, 3, 4, 5, 6] } else { vec![3, 6] };
            assert_eq!(steps, want, "draining: {draining}");
        }
    }

    /// A task being handed off (its partition drains for a rebalance: its hooks say so) has its
    /// state kept after every step, while the task beside it keeps the bucket's `checkpoint_every`.
    #[tokio::test]
    async fn a_task_handed_off_keeps_its_state_after_every_step() {
        struct Handoff(bool);
        impl crate::engine::TaskHooks for Handoff {
            fn cancelled(&self) -> bool {
                false
            }
            fn progress(&self, _: usize, _: usize) {}
            fn handed_off(&self) -> bool {
                self.0
            }
        }
        let (a, kept) = checkpointing().await;
        let tasks: Vec<Wrapped> = items([1, 2], 1)
            .into_iter()
            .map(|item| {
                let hooks: Arc<dyn crate::engine::TaskHooks> = Arc::new(Handoff(item.1 == "1"));
                Wrapped {
                    item,
                    lane: Priority::Standard,
                    hooks: Some(hooks),
                }
            })
            .collect();
        a.run(&stepped_bucket(7, Some(3)), tasks, |done| {
            if let Done::Failed { error, .. } = done {
                panic!("{error}")
            }
        })
        .await;
        assert_eq!(kept.steps(Some("1")), vec![1, 2, 3, 4, 5, 6], "handed off");
        assert_eq!(kept.steps(Some("2")), vec![3, 6], "staying");
    }

    /// `checkpoint_seconds` keeps a task's state once that long has gone by since it was last
    /// kept, whatever the steps: with none (zero) after every step before the last, with an hour
    /// never in a short run; with `checkpoint_every` beside it, at its steps too.
    #[tokio::test]
    async fn checkpoints_fall_after_checkpoint_seconds_whatever_the_steps() {
        let cases = [
            (None, Duration::ZERO, vec![1, 2, 3, 4, 5, 6]),
            (None, Duration::from_secs(3600), vec![]),
            (Some(3), Duration::from_secs(3600), vec![3, 6]),
        ];
        for (every, seconds, want) in cases {
            let mut b = stepped_bucket(7, every);
            let stepped = Stepped {
                checkpoint_seconds: Some(seconds),
                ..b.key.steps().unwrap().clone()
            };
            b.key = CallKey::new("stepped", None).stepped(stepped);
            let (a, kept) = checkpointing().await;
            run(&a, &b, items([1], 1)).await;
            assert_eq!(kept.steps(None), want, "every {every:?} steps, {seconds:?}");
        }
    }

    /// A test task in a lane of its own, with hooks of its own.
    struct Wrapped {
        item: Item,
        lane: Priority,
        hooks: Option<Arc<dyn crate::engine::TaskHooks>>,
    }

    impl BatchItem for Wrapped {
        fn prepared(&self) -> &Prepared {
            self.item.prepared()
        }
        fn id(&self) -> String {
            self.item.id()
        }
        fn dimensions(&self) -> String {
            self.item.dimensions()
        }
        fn lane(&self) -> Priority {
            self.lane
        }
        fn hooks(&self) -> Option<Arc<dyn crate::engine::TaskHooks>> {
            self.hooks.clone()
        }
    }

    /// Hands out `late` tasks from the first step boundary on, one a boundary, as the room
    /// allows; notes the room asked each time.
    struct Arrivals {
        late: VecDeque<Item>,
        rooms: Vec<usize>,
    }

    impl Joining<Item> for Arrivals {
        fn more(&mut self, room: usize) -> BoxFuture<'_, Vec<Item>> {
            self.rooms.push(room);
            // Nothing at the first ask (before the first call): they arrive while it runs.
            let n = if self.rooms.len() < 2 {
                0
            } else {
                room.min(self.late.len()).min(1)
            };
            let joined = self.late.drain(..n).collect();
            Box::pin(async move { joined })
        }
    }

    /// Runs `items` as a running set that the tasks of `joining` join: each task as it is
    /// reported (and told to `reported` then), with its first output row and the batch size it
    /// left.
    async fn run_joined(
        a: &Adaptive,
        b: &Bucket,
        items: Vec<Item>,
        joining: &mut dyn Joining<Item>,
        mut reported: impl FnMut(&str),
    ) -> Vec<(String, f32, usize)> {
        let mut done = Vec::new();
        a.run_joined(b, items, Some(joining), |d| match d {
            Done::Ran {
                items,
                outputs,
                batch_size,
                ..
            } => {
                let y = outputs[0].f32_rows(0, items.len()).unwrap().to_vec();
                for (i, y) in items.into_iter().zip(y) {
                    reported(&i.1);
                    done.push((i.1, y, batch_size));
                }
            }
            Done::Failed { error, .. } => panic!("{error}"),
        })
        .await;
        done
    }

    /// A task that arrives while a step-by-step batch runs joins its next call at its own first
    /// step, and each task leaves (is reported) when its own steps end, counting exactly its
    /// steps: task 1 runs steps 0..4 in calls 1–4, task 2 joins at call 2 and runs 0..4 in
    /// calls 2–5; five calls where one after the other took eight.
    #[tokio::test]
    async fn a_task_joins_a_running_batch_at_the_next_step_and_leaves_when_its_steps_end() {
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(1);
        let b = stepped_bucket(4, None);
        let mut arrivals = Arrivals {
            late: items([2], 1).into(),
            rooms: Vec::new(),
        };
        let done = run_joined(&a, &b, items([1], 1), &mut arrivals, |_| {}).await;
        assert_eq!(done, vec![("1".into(), 4.0, 2), ("2".into(), 4.0, 2)]);
        assert_eq!(*device.steps.lock().unwrap(), vec![0..1, 1..2, 2..3, 3..4, 3..4]);
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 5);
        // Without steps per call, nothing joins: the batch runs in one call.
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        let mut arrivals = Arrivals {
            late: items([2], 1).into(),
            rooms: Vec::new(),
        };
        let done = run_joined(&a, &b, items([1], 1), &mut arrivals, |_| {}).await;
        assert_eq!(
            done.iter().map(|(id, _, size)| (id.as_str(), *size)).collect::<Vec<_>>(),
            vec![("1", 1)]
        );
        assert!(arrivals.rooms.is_empty() && arrivals.late.len() == 1);
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// Tasks join only as far as the bucket's limit: with a limit of two, task 2 joins task 1,
    /// the pair asks for no one, and task 3 joins when task 1 leaves.
    #[tokio::test]
    async fn joins_stay_within_the_buckets_limit() {
        let (a, device, _) = adaptive(64, 1, 2, 16, true).await;
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(1);
        let mut arrivals = Arrivals {
            late: items([2, 3], 1).into(),
            rooms: Vec::new(),
        };
        let done = run_joined(&a, &stepped_bucket(3, None), items([1], 1), &mut arrivals, |_| {}).await;
        assert_eq!(done, vec![("1".into(), 3.0, 2), ("2".into(), 3.0, 2), ("3".into(), 3.0, 2)]);
        assert_eq!(arrivals.rooms, vec![1, 1, 0, 1, 1, 1], "no room while the pair runs");
        assert_eq!(device.peak.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// A set does not wait at a step boundary for a joiner still being prepared (its start
    /// record, say, a commit round trip away): the joiner here is ready only once task 1 has
    /// been reported, which a set that waited for it would never reach. Task 1 runs its steps
    /// alone; the joiner, prepared and marked started, runs after it rather than being lost.
    #[tokio::test]
    async fn a_running_set_goes_on_while_a_joiner_is_prepared() {
        struct Held {
            item: Option<Item>,
            asks: usize,
            release: Arc<tokio::sync::Notify>,
        }
        impl Joining<Item> for Held {
            fn more(&mut self, room: usize) -> BoxFuture<'_, Vec<Item>> {
                self.asks += 1;
                let item = if self.asks >= 2 && room > 0 { self.item.take() } else { None };
                let release = self.release.clone();
                Box::pin(async move {
                    if item.is_some() {
                        release.notified().await;
                    }
                    item.into_iter().collect()
                })
            }
        }
        let (a, _, _) = adaptive(64, 1, 8, 16, true).await;
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(1);
        let release = Arc::new(tokio::sync::Notify::new());
        let mut held = Held {
            item: items([2], 1).pop(),
            asks: 0,
            release: release.clone(),
        };
        let b = stepped_bucket(4, None);
        let run = run_joined(&a, &b, items([1], 1), &mut held, |id| {
            if id == "1" {
                release.notify_one();
            }
        });
        let done = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the set waited at a boundary for its joiner");
        assert_eq!(done, vec![("1".into(), 4.0, 1), ("2".into(), 4.0, 1)]);
    }

    /// An out-of-memory error in a running set that tasks joined halves it, and every task,
    /// the ones that joined too, carries on from the step it reached.
    #[tokio::test]
    async fn an_out_of_memory_error_in_a_running_set_keeps_every_tasks_steps() {
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        device.oom_from_step.store(2, std::sync::atomic::Ordering::SeqCst);
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(1);
        let mut arrivals = Arrivals {
            late: items([2], 1).into(),
            rooms: Vec::new(),
        };
        let done = run_joined(&a, &stepped_bucket(4, None), items([1], 1), &mut arrivals, |_| {}).await;
        let mut ids: Vec<&str> = done.iter().map(|(id, _, _)| id.as_str()).collect();
        ids.sort();
        assert_eq!(ids, vec!["1", "2"]);
        assert!(done.iter().all(|(_, y, _)| *y == 4.0), "each counts its four steps once: {done:?}");
    }

    /// An interactive batch runs all its steps in one call, whatever the steps per call: it has
    /// no one to make room for at the gate.
    #[tokio::test]
    async fn an_interactive_batch_runs_its_steps_in_one_call() {
        let (a, device, _) = adaptive(64, 1, 8, 16, true).await;
        let a = Arc::into_inner(a).expect("one owner").with_steps_per_call(1);
        let items: Vec<Wrapped> = items([1, 2], 1)
            .into_iter()
            .map(|item| Wrapped {
                item,
                lane: Priority::Interactive,
                hooks: None,
            })
            .collect();
        let mut outputs = Vec::new();
        a.run(&stepped_bucket(5, None), items, |done| match done {
            Done::Ran { outputs: o, .. } => outputs.push(o),
            Done::Failed { error, .. } => panic!("{error}"),
        })
        .await;
        assert_eq!(device.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(device.steps.lock().unwrap().is_empty(), "one call of every step");
        assert_eq!(outputs.len(), 1);
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

    fn whole(seeds: impl IntoIterator<Item = u64>, rows: usize) -> Vec<Item> {
        seeds.into_iter().map(|s| Item(prepared_whole(s, rows), s.to_string())).collect()
    }

    #[tokio::test]
    async fn a_task_that_does_not_fit_even_alone_fails_on_its_own() {
        let (a, _, metrics) = adaptive(4, 1, 8, 16, true).await;
        let (sizes, ran, failed) = run(&a, &bucket(5), whole([1, 2], 5)).await;
        assert!(sizes.is_empty() && ran.is_empty());
        assert_eq!(failed.len(), 2);
        assert!(failed.iter().all(|(_, e)| e.is_oom()));
        assert_eq!(a.limit(&bucket(5)), 1);
        // Halved once (2 -> 1); the bucket is then down to one, so each runs alone with the
        // device to itself at once, and fails there.
        assert_eq!(metrics.ooms(&bucket(5).label()), 1 + 2);
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
        assert_eq!(metrics.ooms(&bucket(1).label()), 2);
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

    /// A task whose rows don't fit together runs them in halves, down to one row, before it
    /// fails: its outputs are whole and in order, and its bucket remembers the parts.
    #[tokio::test]
    async fn a_task_whose_rows_do_not_fit_together_runs_them_in_smaller_parts() {
        let (a, device, metrics) = adaptive(3, 1, 8, 16, true).await;
        let outputs = run_ten_rows(&a).await;
        let want: Vec<f32> = (0..10).map(|r| 2.0 * r as f32).collect();
        assert_eq!(outputs[0][0].f32_rows(0, 10).unwrap(), want.as_slice());
        assert!(device.peak.load(std::sync::atomic::Ordering::SeqCst) <= 3);
        // 10 rows, then parts of 5, then of 2: two out-of-memory errors.
        assert_eq!(metrics.ooms(&bucket(10).label()), 2);
        assert_eq!(a.part_rows(&bucket(10)), 2);
        // The next task of the bucket starts in parts of 2.
        let (_, ran, failed) = run(&a, &bucket(10), items([4], 10)).await;
        assert_eq!((ran.len(), failed.len()), (1, 0));
        assert_eq!(metrics.ooms(&bucket(10).label()), 2);
    }

    /// A rebuild of the sessions on a clean arena, as the worker's serving layer does it.
    struct Rebuild(Engine, Arc<std::sync::atomic::AtomicUsize>);

    impl CleanArena for Rebuild {
        fn clean(&self) -> BoxFuture<'_, Result<Cleaned, EngineError>> {
            Box::pin(async move {
                self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                self.0.rebuild(|| Ok(())).await?;
                Ok(Cleaned::default())
            })
        }
    }

    /// A runner of at most 16 tasks per call over one engine thread on `device`, rebuilding its
    /// sessions (counted) when it needs a clean arena, if `cleaner`.
    async fn on_device(device: &Arc<Device>, probe_after: u32, cleaner: bool) -> (Adaptive, Arc<std::sync::atomic::AtomicUsize>) {
        let engine = Engine::start(1);
        let model = Arc::new(FakeModel { device: device.clone() });
        engine
            .load("fake", Arc::new(move || model.load(std::path::Path::new(""), &Default::default())))
            .await
            .unwrap();
        let rebuilds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let limits = BatchSize {
            max_tasks: 16,
            max_rows: 1024,
        };
        let mut a = Adaptive::new(engine.clone(), limits, probe_after, true, Metrics::new());
        if cleaner {
            a = a.with_cleaner(Arc::new(Rebuild(engine, rebuilds.clone())));
        }
        (a, rebuilds)
    }

    /// On a device that every out-of-memory error fragments further, halving alone ends with
    /// singles that fail although they fit; a clean arena before the verdict runs them all.
    /// What does not fit on a clean arena fails, after one rebuild for its bucket.
    #[tokio::test]
    async fn only_an_out_of_memory_on_a_clean_arena_fails_a_task() {
        let fragmenting = |cleaner: bool| async move {
            let device = Device::fragmenting(4, Duration::from_millis(5), 2);
            let (a, rebuilds) = on_device(&device, 16, cleaner).await;
            (a, device, rebuilds)
        };
        // Without a clean arena: 16, 8, 4 and 2 fail and leave the device too fragmented for one.
        let (a, _, _) = fragmenting(false).await;
        let (_, ran, failed) = run(&a, &bucket(1), items(0..16, 1)).await;
        assert!(
            !failed.is_empty(),
            "the fragmented device fails singles that fit: {} ran",
            ran.len()
        );

        let (a, device, rebuilds) = fragmenting(true).await;
        let (_, ran, failed) = run(&a, &bucket(1), items(0..16, 1)).await;
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(ran.len(), 16);
        // One rebuild for the single's verdict, one for the probe above the ceiling learned on
        // the fragmented device.
        assert_eq!(rebuilds.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(device.loads.load(std::sync::atomic::Ordering::SeqCst), 3, "loaded, rebuilt twice");
        assert_eq!(a.metrics.clean_arena_retries.with_label_values(&["fit"]).get(), 1);

        // Five rows that can't be cut apart never fit: one rebuild gives the verdict, and the
        // next task of the same shape fails without another.
        let (_, ran, failed) = run(&a, &bucket(5), whole([1, 2], 5)).await;
        assert!(ran.is_empty());
        assert_eq!(failed.len(), 2);
        assert!(failed.iter().all(|(_, e)| e.is_oom()));
        assert_eq!(rebuilds.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(a.metrics.clean_arena_retries.with_label_values(&["does_not_fit"]).get(), 1);
        // Other buckets still run.
        assert_eq!(run(&a, &bucket(1), items(20..21, 1)).await.1.len(), 1);
    }

    /// Where failed calls of sizes not known to fit give their pieces back (ONNX Runtime's arena
    /// shrinkage), halving finds what fits without a rebuild.
    #[tokio::test]
    async fn a_call_that_may_not_fit_leaves_no_pieces_where_the_arena_shrinks() {
        let device = Device::shrinking(8, Duration::from_millis(5), 2);
        let (a, rebuilds) = on_device(&device, 4, true).await;
        // 16 fails and gives its pieces back as it ends, so 8 fits on the arena it left (had 16
        // left its pieces, 8 would fail too and 4 would be learned).
        let (sizes, ran, failed) = run(&a, &bucket(1), items(0..16, 1)).await;
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(ran.len(), 16);
        assert_eq!(sizes, vec![8, 8]);
        assert_eq!(rebuilds.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(a.metrics.ooms(&bucket(1).label()), 1);
        // A known size runs on the arena as it is; the probe above it (9) fails and 8 fits
        // after on the arena the probe left, with no rebuild.
        let (sizes, _, failed) = run(&a, &bucket(1), items(16..56, 1)).await;
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(sizes, vec![8; 5]);
        assert_eq!(a.metrics.ooms(&bucket(1).label()), 2, "one failed probe");
        assert_eq!(rebuilds.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(device.loads.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// A store in memory, as a restarted worker finds the ceilings topic.
    #[derive(Default)]
    struct Kept(Mutex<HashMap<String, Learned>>);

    impl CeilingStore for Kept {
        fn get(&self, bucket: &str) -> Option<Learned> {
            self.0.lock().unwrap().get(bucket).copied()
        }
        fn put(&self, bucket: &str, learned: Option<Learned>) {
            let mut kept = self.0.lock().unwrap();
            match learned {
                Some(l) => kept.insert(bucket.to_owned(), l),
                None => kept.remove(bucket),
            };
        }
    }

    /// As [`adaptive`] (one engine thread, at most 8 tasks per call), keeping ceilings in `store`.
    async fn kept(capacity: usize, probe_after: u32, store: &Arc<Kept>) -> (Adaptive, Metrics) {
        let (a, _, metrics) = adaptive(capacity, 1, 8, probe_after, true).await;
        let limits = BatchSize {
            max_tasks: 8,
            max_rows: 1024,
        };
        let a = Adaptive::new(a.engine.clone(), limits, probe_after, true, metrics.clone()).with_store(store.clone());
        (a, metrics)
    }

    /// What a runner learned is kept; a new one (a restarted worker) starts there and runs
    /// into no out-of-memory error again; a probe's raise is kept only once a batch proved it.
    /// A probe that failed is remembered with the ceiling: a restarted runner waits as long
    /// before probing again as the one that learned it would have (here 4 clean batches, not 2),
    /// so it does not run into the same out-of-memory error at once.
    #[tokio::test]
    async fn a_failed_probe_is_remembered_across_restarts() {
        let store = Arc::new(Kept::default());
        let (a, metrics) = kept(4, 2, &store).await;
        run(&a, &bucket(1), items(0..8, 1)).await;
        assert_eq!(a.limit(&bucket(1)), 5, "probing");
        run(&a, &bucket(1), items(8..13, 1)).await;
        assert_eq!(metrics.ooms(&bucket(1).label()), 2, "the first call and the probe");
        let key = bucket(1).to_string();
        assert_eq!(
            store.get(&key),
            Some(Learned {
                limit: 4,
                part_rows: None,
                probe_backoff: 2
            })
        );

        let (b, metrics) = kept(4, 2, &store).await;
        assert_eq!(run(&b, &bucket(1), items(0..16, 1)).await.0, vec![4; 4]);
        assert_eq!(metrics.ooms(&bucket(1).label()), 0);
        assert_eq!(b.limit(&bucket(1)), 5, "it still probes, after 4 clean batches");
    }

    #[tokio::test]
    async fn a_restarted_runner_starts_at_the_stored_ceiling() {
        let store = Arc::new(Kept::default());
        let (a, metrics) = kept(4, 2, &store).await;
        assert_eq!(run(&a, &bucket(1), items(0..8, 1)).await.0, vec![4, 4]);
        assert_eq!(metrics.ooms(&bucket(1).label()), 1);
        let key = bucket(1).to_string();
        assert_eq!(
            store.get(&key),
            Some(Learned {
                limit: 4,
                part_rows: None,
                probe_backoff: 1
            })
        );
        assert_eq!(a.limit(&bucket(1)), 5, "probing");
        assert_eq!(store.get(&key).unwrap().limit, 4, "an unproved probe is not kept");

        let (b, metrics) = kept(4, 16, &store).await;
        assert_eq!(b.limit(&bucket(1)), 4, "starts at the stored ceiling");
        assert_eq!(run(&b, &bucket(1), items(0..12, 1)).await.0, vec![4, 4, 4]);
        assert_eq!(metrics.ooms(&bucket(1).label()), 0);

        // A ceiling that probes back up to its maximum is forgotten.
        let (c, _) = kept(64, 1, &store).await;
        for _ in 0..5 {
            let n = c.limit(&bucket(1));
            run(&c, &bucket(1), items(0..n as u64, 1)).await;
        }
        assert_eq!(c.limit(&bucket(1)), 8);
        assert_eq!(store.get(&key), None);
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

    /// A running set takes its turn at the device as its newest task: a set that a task has
    /// just joined ranks as a new batch, not behind every batch that came after it began.
    #[test]
    fn a_running_set_takes_its_turn_as_its_newest_task() {
        let call = |ids: &[&str]| Call {
            key: CallKey::none(),
            inputs: Vec::new(),
            tasks: ids
                .iter()
                .map(|id| CallTask {
                    id: id.to_string(),
                    attempt: 1,
                    rows: 1,
                    hooks: None,
                })
                .collect(),
        };
        let mut calls_of = HashMap::new();
        let turns: Vec<u32> = [
            &["a", "b"][..],
            &["a", "b"],
            &["a", "b"],
            &["a", "b", "c"],
            &["b", "c"],
            &["c"],
            &["c"],
        ]
        .iter()
        .map(|ids| newest_turns(&call(ids), &mut calls_of))
        .collect();
        // a and b had 0, 1, 2 calls; c joins with none; a leaves; c alone goes on counting.
        assert_eq!(turns, vec![0, 1, 2, 0, 1, 2, 3]);
    }
}
