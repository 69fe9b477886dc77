//! The stages of one task's life, joined by bounded channels:
//!
//! ```text
//! source ─▶ decode ─▶ batcher ─▶ engine ─▶ finish (render, sink) ─▶ outcome ─▶ offsets
//! ```
//!
//! Every task carries its origin; whichever stage finishes it hands it to [`Outcomes`], the one
//! place that announces outcomes and acknowledges offsets.

pub(crate) mod running;
pub(crate) mod task;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sluice_schemas::{CompletionStatus, DlqReason, OutputRef, Timings, decode_task};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::batching::adaptive::{Adaptive, BatchItem, Done};
use crate::batching::batcher::{Batch, BatchRequests};
use crate::engine::{EngineError, Tensor};
use crate::events::{Emit, MemorySampled};
use crate::metrics::Metrics;
use crate::models::serving::Serving;
use crate::models::{Bucket, ModelError, Prepared};
use crate::outcome::{Failed, Outcomes, Success, TaskIdentity};
use crate::panics;
use crate::pipeline::task::{Failure, Job, Record};
use crate::retry::{RetryPolicy, retry};
use crate::source::crash_guard::{CrashGuard, Verdict};
use crate::source::offsets::Offsets;
use crate::source::redelivery::RedeliveryCheck;
use crate::storage::images::ImageStore;

/// What every stage shares.
pub(crate) struct Shared {
    pub offsets: Arc<Offsets>,
    pub outcomes: Outcomes,
    pub images: ImageStore,
    pub serving: Arc<Serving>,
    pub adaptive: Arc<Adaptive>,
    pub redelivery: Arc<dyn RedeliveryCheck>,
    /// Records model calls' starts; sends records that keep killing workers to the DLQ.
    pub crash_guard: CrashGuard,
    /// Task ids in flight: a second record of one waits for the first, then for its results.
    pub running: Arc<crate::pipeline::running::Running>,
    pub metrics: Metrics,
    pub worker_id: String,
    pub max_task_bytes: usize,
    /// The served models' entries: the bounds of one task's work.
    pub catalog: Arc<sluice_schemas::Catalog>,
    /// Storage retries: bounded, then `retries_exhausted`.
    pub storage_retry: RetryPolicy,
    /// Fires when the worker gives up on what is in flight (shutdown grace over, fatal error).
    pub abandon: CancellationToken,
    /// Bounds tasks being rendered and stored at once.
    pub finishing: Semaphore,
    /// Every spawned per-task future, so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// Progress records of multi-step models (none in unit tests).
    pub progress: Option<crate::outcome::progress::ProgressSink>,
    /// Tasks cancelled by their clients (the control topic).
    pub cancellations: crate::source::cancellations::Cancellations,
}

/// A prepared task inside a batch.
struct Item {
    job: Job,
    prepared: Prepared,
    progress: Option<Arc<crate::outcome::progress::TaskProgress>>,
}

impl BatchItem for Item {
    fn prepared(&self) -> &Prepared {
        &self.prepared
    }
    fn id(&self) -> String {
        self.job.task.task_id.to_string()
    }
    fn dimensions(&self) -> String {
        let r = &self.job.task.request;
        format!("{}x{}x{}", r.width, r.height, r.num_images)
    }
    fn hooks(&self) -> Option<Arc<dyn crate::engine::TaskHooks>> {
        self.progress.clone().map(|p| p as Arc<dyn crate::engine::TaskHooks>)
    }
}

/// Decode: parse and validate each record; bad ones fail at once, good ones that may have been
/// started before are checked for results, the rest go to the batcher.
pub(crate) async fn decode(mut input: mpsc::Receiver<Record>, to_batcher: mpsc::Sender<(Bucket, Job)>, shared: Arc<Shared>) {
    while let Some(record) = input.recv().await {
        if !shared.offsets.keep_or_release(&record.origin) {
            continue; // revoked or being revoked while queued; the new owner reads it again
        }
        // Before anything of the partition can be committed, a record that fails at once
        // included (a partition holding only those would otherwise never be).
        shared.redelivery.know_partition(&record.origin).await;
        let Some((bucket, mut job)) = admit(&shared, record) else {
            continue;
        };
        let replayed = job.record.header(sluice_schemas::HEADER_ORIGIN).is_some();
        // A task submitted with an Idempotency-Key may have been published twice (two producer
        // replicas, a retry while one caught up): its results may exist already.
        let check = shared.redelivery.admit(&job.record.origin, replayed).await || job.task.idempotency.is_some();
        let current = |o: &crate::pipeline::task::Origin| shared.offsets.is_current(o);
        let earlier = match shared.running.claim(job.task.task_id, &job.record.origin, current) {
            Ok(claim) => {
                job.claim = Some(claim);
                false
            }
            Err(_) => true, // another record of this task is in flight here
        };
        if !check && !earlier {
            // No earlier delivery can have started it: no results to look for.
            if let Some((bucket, job)) = guard(&shared, bucket, job) {
                let _ = to_batcher.send((bucket, job)).await;
            }
            continue;
        }
        // The check is a storage round trip (after the earlier record of the same task, if one
        // is in flight): run it concurrently, not in line.
        let (shared2, to_batcher) = (shared.clone(), to_batcher.clone());
        shared.tasks.spawn(async move {
            if earlier {
                let current = |o: &crate::pipeline::task::Origin| shared2.offsets.is_current(o);
                job.claim = Some(
                    shared2
                        .running
                        .claim_after_others(job.task.task_id, &job.record.origin, current)
                        .await,
                );
            }
            if let Some((bucket, job)) = announce_if_done(&shared2, job).await.and_then(|job| guard(&shared2, bucket, job)) {
                let _ = to_batcher.send((bucket, job)).await;
            }
        });
    }
}

/// The crash guard's verdict on a task with no earlier results: it runs (alone, when an earlier
/// worker started it and died), or goes to the DLQ after `SLUICE_MAX_CRASHES` such starts.
fn guard(shared: &Shared, bucket: Bucket, job: Job) -> Option<(Bucket, Job)> {
    let origin = &job.record.origin;
    match shared.crash_guard.verdict(origin) {
        Verdict::Run => Some((bucket, job)),
        Verdict::Alone { starts } => {
            tracing::warn!(parent: &job.span, starts, "started before by a worker that stopped before it finished; running it alone");
            let alone = Some((origin.partition, origin.offset));
            Some((Bucket { alone, ..bucket }, job))
        }
        Verdict::Crashed { starts } => {
            let message = format!(
                "started {starts} times without an outcome: each start ended the worker that ran it \
                 (an abort, a crash in native code or an OOM kill; SLUICE_MAX_CRASHES)"
            );
            tracing::error!(parent: &job.span, starts, "a record that keeps killing workers goes to the DLQ");
            shared.outcomes.fail(job, Failure::new(DlqReason::Crashed, message));
            None
        }
    }
}

/// The job and bucket of a record, or `None` after failing it (too large, undecodable, a model
/// not served here, parameters its model refuses).
fn admit(shared: &Shared, record: Record) -> Option<(Bucket, Job)> {
    let outcomes = &shared.outcomes;
    if record.value.len() > shared.max_task_bytes {
        let failure = Failure::new(
            DlqReason::TooLarge,
            format!("record is {} bytes; the limit is {}", record.value.len(), shared.max_task_bytes),
        );
        outcomes.fail(
            Failed::Record {
                record,
                identity: TaskIdentity::default(),
            },
            failure,
        );
        return None;
    }
    let task = match decode_task(&record.value, record.header(sluice_schemas::HEADER_SCHEMA_VERSION)) {
        Ok(task) => task,
        Err(bad) => {
            let mut failure = Failure::new(bad.error.reason(), bad.error.to_string());
            if let sluice_schemas::DecodeError::Schema(violations) = &bad.error {
                failure = failure.with_violations(violations);
            }
            let identity = TaskIdentity {
                task_id: bad.task_id,
                tenant: bad.tenant,
                model: bad.model,
                user: None,
            };
            outcomes.fail(Failed::Record { record, identity }, failure);
            return None;
        }
    };
    let trace_id = crate::outcome::publish::TraceHeaders::of(&record)
        .map(|t| t.trace_id().to_owned())
        .unwrap_or_default();
    let span =
        tracing::info_span!("task", task_id = %task.task_id, trace_id, partition = record.origin.partition, offset = record.origin.offset);
    let job = Job {
        record,
        task,
        span,
        claim: None,
    };
    let Some(adapter) = shared.serving.adapter(&job.task.model) else {
        let failure = Failure::new(
            DlqReason::UnsupportedModel,
            format!(
                "model {:?} is not served here (serving {:?})",
                job.task.model,
                shared.serving.names()
            ),
        );
        outcomes.fail(job, failure);
        return None;
    };
    // The bounds of one task's work, as the producer checks them: a record can reach the topic
    // without the producer, and one oversized task must not take the worker's memory.
    if let Some(entry) = shared.catalog.get(&job.task.model) {
        let violations = entry.check_work(&job.task.request);
        if !violations.is_empty() {
            let message = violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
            outcomes.fail(job, Failure::new(DlqReason::SchemaViolation, message).with_violations(&violations));
            return None;
        }
    }
    // Whatever goes wrong at admission (a panic included) refuses the task as it was asked.
    match panics::catch(|| adapter.bucket(&job.task))
        .map_err(ModelError::Panicked)
        .and_then(|b| b)
    {
        Ok(bucket) => Some((bucket, job)),
        Err(e) => {
            outcomes.fail(job, Failure::new(DlqReason::SchemaViolation, e.to_string()));
            None
        }
    }
}

/// If an earlier attempt finished the task (its manifest exists), announces it again from the
/// manifest; otherwise hands the job back.
async fn announce_if_done(shared: &Arc<Shared>, job: Job) -> Option<Job> {
    let task_id = job.task.task_id;
    let manifest = retry(shared.storage_retry, "manifest_check", &shared.metrics, &shared.abandon, || {
        shared.images.manifest(task_id)
    })
    .await;
    let manifest = match manifest {
        Ok(Some(m)) => m,
        Ok(None) => return Some(job),
        Err(gave_up) => {
            shared.outcomes.gave_up(job, "checking for earlier results", gave_up);
            return None;
        }
    };
    let timings = Timings {
        total_ms: job.age_ms(Utc::now()),
        inference_ms: manifest.inference_ms.unwrap_or(0),
        ..Timings::default()
    };
    let success = Success {
        outputs: manifest.outputs,
        timings,
        duplicate: true,
        upload: Duration::ZERO,
    };
    shared.outcomes.succeed(&job, success).await;
    None
}

/// The engine stage: pulls batches and runs up to `concurrency` of them at once (one more than
/// the engine slots, so the next batch is prepared while one runs).
pub(crate) async fn engine(requests: BatchRequests<Job>, shared: Arc<Shared>, concurrency: usize) {
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    loop {
        let permit = permits.clone().acquire_owned().await.expect("never closed");
        let Some(batch) = requests.next().await else { break };
        let shared2 = shared.clone();
        shared.tasks.spawn(async move {
            run_batch(&shared2, batch).await;
            drop(permit);
        });
    }
}

async fn run_batch(shared: &Arc<Shared>, batch: Batch<Job>) {
    let Batch { bucket, items } = batch;
    let jobs = still_wanted(shared, items);
    if jobs.is_empty() {
        return;
    }
    let Some(items) = prepare(shared, &bucket, jobs).await else {
        return;
    };
    let Some(_held) = shared.serving.hold(&bucket.model).await else {
        tracing::error!(model = %bucket.model, "model is not loaded; leaving its tasks for a restarted worker");
        return;
    };
    // Durably, before the call: should it kill the process, the next owner knows what ran.
    let _alone = match bucket.alone {
        Some(_) => Some(shared.crash_guard.alone().await),
        None => None,
    };
    let origins: Vec<&crate::pipeline::task::Origin> = items.iter().map(|i| &i.job.record.origin).collect();
    shared.crash_guard.starting(&origins).await;
    shared.adaptive.run(&bucket, items, |done| on_done(shared, &bucket, done)).await;
}

/// The jobs of a batch that are still to run: not from a partition this worker lost, not
/// cancelled while queued, not past their deadline (those two are announced as such, unrun).
fn still_wanted(shared: &Arc<Shared>, jobs: Vec<Job>) -> Vec<Job> {
    let mut wanted = Vec::with_capacity(jobs.len());
    for job in jobs {
        if !shared.offsets.keep_or_release(&job.record.origin) {
            continue; // revoked, or released by a draining partition
        }
        let ended = if shared.cancellations.contains(&job.task.task_id) {
            // Cancelled while queued: never run.
            Some(CompletionStatus::Cancelled)
        } else if job.task.deadline.is_some_and(|d| d < Utc::now()) {
            // Dequeued past its deadline: not run.
            Some(CompletionStatus::Expired)
        } else {
            None
        };
        match ended {
            Some(status) => {
                let outcomes = shared.outcomes.clone();
                shared.tasks.spawn(async move { outcomes.ended(&job, status).await });
            }
            None => wanted.push(job),
        }
    }
    wanted
}

/// The jobs' model inputs, made on the blocking pool (noise and tiling are CPU work), each task
/// on its own: one that fails (or panics) goes to the DLQ and the others run. `None` when the
/// model is gone or the runtime is shutting down: the tasks stay unacknowledged.
async fn prepare(shared: &Arc<Shared>, bucket: &Bucket, jobs: Vec<Job>) -> Option<Vec<Item>> {
    let adapter = shared.serving.adapter(&bucket.model)?;
    let steps: Vec<Option<u32>> = jobs.iter().map(|j| adapter.steps(&j.task)).collect();
    let prepared = tokio::task::spawn_blocking(move || {
        jobs.into_iter()
            .map(|job| {
                (
                    panics::catch(|| adapter.prepare(&job.task))
                        .map_err(ModelError::Panicked)
                        .and_then(|r| r),
                    job,
                )
            })
            .collect::<Vec<_>>()
    })
    .await
    .ok()?;
    let mut items = Vec::with_capacity(prepared.len());
    for ((result, job), steps) in prepared.into_iter().zip(steps) {
        match result {
            Ok(prepared) => {
                let progress = steps.zip(shared.progress.as_ref()).map(|(steps, sink)| {
                    Arc::new(sink.start(
                        job.task.task_id,
                        &bucket.model,
                        steps,
                        crate::outcome::publish::TraceHeaders::of(&job.record),
                    ))
                });
                items.push(Item { job, prepared, progress })
            }
            Err(e) => shared.outcomes.fail(job, Failure::new(DlqReason::ModelError, e.to_string())),
        }
    }
    Some(items)
}

/// What the adaptive batcher reports of a call: each task that ran is rendered, stored and
/// announced on a task of its own; one that failed goes to its outcome.
fn on_done(shared: &Arc<Shared>, bucket: &Bucket, done: Done<Item>) {
    match done {
        Done::Ran {
            items,
            outputs,
            elapsed,
            batch_size,
        } => {
            let started_at = Utc::now() - chrono::Duration::from_std(elapsed).unwrap_or_default();
            let mut row = 0;
            for item in items {
                let rows = row..row + item.prepared.rows;
                row = rows.end;
                let span = item.job.span.clone();
                let ran = Ran {
                    outputs: outputs.clone(),
                    rows,
                    inference: elapsed,
                    started_at,
                    batch_size,
                };
                shared.tasks.spawn(finish(shared.clone(), item, ran).instrument(span));
            }
        }
        Done::Failed { item, error } => {
            if let Some(failure) = failure_of(shared, &item, bucket, &error) {
                shared.outcomes.fail(item.job, failure);
            }
        }
    }
}

/// The DLQ failure of a task that failed on its own; `None` for an engine failure that is not
/// the task's fault (it is left for redelivery).
fn failure_of(shared: &Shared, item: &Item, bucket: &Bucket, error: &EngineError) -> Option<Failure> {
    let mut details = shared
        .serving
        .adapter(&bucket.model)
        .map(|a| a.describe(&item.job.task))
        .unwrap_or_default();
    details.insert("rows".into(), bucket.rows_per_task.into());
    let failure = match error {
        EngineError::OutOfMemory(m) => Failure::new(
            DlqReason::ResourceExhausted,
            format!("out of memory even at batch 1 ({}): {m}", item.dimensions()),
        ),
        EngineError::Run(_) | EngineError::Load(_) | EngineError::Panicked(_) => Failure::new(DlqReason::ModelError, error.to_string()),
        EngineError::Runtime(_) | EngineError::Stopped => return None,
    };
    Some(failure.with_details(details))
}

struct Ran {
    outputs: Arc<Vec<Tensor>>,
    rows: Range<usize>,
    inference: Duration,
    started_at: chrono::DateTime<Utc>,
    batch_size: usize,
}

/// Render, store, announce.
async fn finish(shared: Arc<Shared>, item: Item, ran: Ran) {
    let _permit = shared.finishing.acquire().await.expect("never closed");
    let Item { job, prepared, .. } = item;
    let rendered = {
        let outputs = ran.outputs.clone();
        let rows = ran.rows.clone();
        tokio::task::spawn_blocking(move || {
            panics::catch(|| prepared.render.render(&outputs, rows))
                .map_err(ModelError::Panicked)
                .and_then(|r| r)
        })
        .await
    };
    let images = match rendered {
        Ok(Ok(images)) => images,
        Ok(Err(ModelError::Cancelled)) => {
            // Stopped between steps: nothing is stored.
            shared.outcomes.ended(&job, CompletionStatus::Cancelled).await;
            return;
        }
        Ok(Err(e)) => {
            shared
                .outcomes
                .fail(job, Failure::new(DlqReason::ModelError, format!("rendering: {e}")));
            return;
        }
        Err(_) => return, // the runtime is shutting down
    };
    let upload_started = Instant::now();
    let task_id = job.task.task_id;
    let stored = retry(shared.storage_retry, "upload", &shared.metrics, &shared.abandon, || async {
        let puts = images
            .iter()
            .enumerate()
            .map(|(i, image)| shared.images.put_image(task_id, i as u32, image));
        let outputs: Vec<OutputRef> = futures::future::try_join_all(puts).await?;
        shared
            .images
            .put_manifest(task_id, &outputs, ran.inference.as_millis() as u64, &shared.worker_id)
            .await?;
        Ok::<_, crate::storage::images::StorageError>(outputs)
    })
    .await;
    let outputs = match stored {
        Ok(outputs) => outputs,
        Err(gave_up) => return shared.outcomes.gave_up(job, "storing images", gave_up),
    };
    let upload = upload_started.elapsed();
    let timings = Timings {
        queued_ms: (ran.started_at - job.task.submitted_at).num_milliseconds().max(0) as u64,
        inference_ms: ran.inference.as_millis() as u64,
        upload_ms: upload.as_millis() as u64,
        total_ms: job.age_ms(Utc::now()),
    };
    let success = Success {
        outputs,
        timings,
        duplicate: false,
        upload,
    };
    if shared.outcomes.succeed(&job, success).await {
        tracing::debug!(batch_size = ran.batch_size, "completed");
    }
}

/// Refreshes the gauges that are read rather than counted.
pub(crate) async fn gauges(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        shared.offsets.observed().emit(&shared.metrics);
        MemorySampled {
            rss_bytes: crate::metrics::rss_bytes(),
            arena: shared.serving.arena_stats(),
        }
        .emit(&shared.metrics);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use futures::future::BoxFuture;
    use sluice_schemas::CompletionEvent;
    use uuid::Uuid;

    use super::*;
    use crate::batching::adaptive::BatchSize;
    use crate::batching::batcher::Batcher;
    use crate::engine::{Engine, SessionOptions};
    use crate::models::Registry;
    use crate::models::serving::Health;
    use crate::outcome::OutcomeSettings;
    use crate::outcome::publish::{Publish, PublishError};
    use crate::source::offsets::TopicPartition;
    use crate::source::redelivery::RedeliveryCheck;
    use crate::testing::fake::{Device, ERROR_SEED, FakeModel, PANIC_SEED};

    /// What the recording publisher saw: per offset, the kind of record, whether the record was
    /// still unacknowledged then, and the partition's commit candidate at that moment.
    #[derive(Debug, Clone, PartialEq)]
    struct Published {
        offset: i64,
        kind: &'static str,
        pending: bool,
        commit_at_publish: Option<i64>,
    }

    struct Recorder {
        offsets: Arc<Offsets>,
        seen: Mutex<Vec<Published>>,
    }

    impl Recorder {
        fn note(&self, tp: TopicPartition, offset: i64, kind: &'static str) {
            let commit_at_publish = self.offsets.commit_candidates().first().map(|c| c.offset);
            self.seen.lock().unwrap().push(Published {
                offset,
                kind,
                pending: self.offsets.is_pending(&tp, offset),
                commit_at_publish,
            });
        }
    }

    impl Publish for Recorder {
        fn completion<'a>(
            &'a self,
            _origin: &'a crate::pipeline::task::Origin,
            event: &'a CompletionEvent,
            _trace: Option<&'a crate::outcome::publish::TraceHeaders>,
        ) -> BoxFuture<'a, Result<(), PublishError>> {
            let kind = event.status.as_str();
            let tp = TopicPartition {
                topic: event.source.topic.as_str().into(),
                partition: event.source.partition,
            };
            self.note(tp, event.source.offset, kind);
            Box::pin(async { Ok(()) })
        }

        fn dead_letter<'a>(&'a self, record: &'a Record, _: &'a Failure, _: Option<Uuid>) -> BoxFuture<'a, Result<(), PublishError>> {
            self.note(TopicPartition::of(&record.origin), record.origin.offset, "dlq");
            Box::pin(async { Ok(()) })
        }
    }

    /// Every record is a first delivery (this test is about ordering, not redelivery).
    struct NeverStarted;

    impl RedeliveryCheck for NeverStarted {
        fn admit<'a>(&'a self, _: &'a crate::pipeline::task::Origin, _: bool) -> BoxFuture<'a, bool> {
            Box::pin(async { false })
        }
    }

    fn record(offsets: &Offsets, tp: &TopicPartition, offset: i64, value: Vec<u8>) -> Record {
        Record {
            origin: offsets.track(tp, offset).expect("assigned"),
            key: None,
            value,
            headers: vec![("sluice-schema-version".into(), Some(b"1".to_vec()))],
            timestamp_ms: None,
            received_at: std::time::Instant::now(),
        }
    }

    fn task(seed: u64, images: u32) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "version": 1, "task_id": Uuid::now_v7(), "submitted_at": Utc::now(), "tenant": "t", "user": null, "model": "terrain",
            "request": {"prompt": "", "negative_prompt": "", "steps": 1, "guidance_scale": 1.0, "seed": seed, "sampler": "onestep",
                        "width": 128, "height": 128, "num_images": images, "params": {}}
        }))
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tasks_finish_out_of_order_and_offsets_are_acknowledged_only_after_their_outcome() {
        let dir = std::env::temp_dir().join(format!("sluice-pipeline-{}", Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("models/terrain")).unwrap();
        std::fs::write(dir.join("models/terrain/model.onnx"), b"fake").unwrap();
        let metrics = Metrics::new();
        let offsets = Arc::new(Offsets::new());
        let tp = TopicPartition {
            topic: "tasks".into(),
            partition: 0,
        };
        offsets.assign(std::slice::from_ref(&tp));
        offsets.lease_known(std::slice::from_ref(&tp));
        let recorder = Arc::new(Recorder {
            offsets: offsets.clone(),
            seen: Mutex::new(Vec::new()),
        });
        // A device of 6 rows, two engine threads: batches of three buckets (1, 2, 3 images per
        // task) finish at different times, and some halve.
        let engine = Engine::start(2);
        let registry = Registry::default().with(
            "terrain",
            Arc::new(FakeModel {
                device: Device::new(6, Duration::from_millis(5)),
            }),
        );
        let (health, _) = tokio::sync::watch::channel(Health::default());
        let serving = Serving::start(
            engine.clone(),
            None,
            &registry,
            &[("terrain".to_owned(), dir.join("models/terrain"))],
            SessionOptions::default(),
            metrics.clone(),
            health,
            0,
        )
        .await
        .unwrap();
        let sink = ImageStore::from_url(&format!("file://{}", dir.join("out").display())).unwrap();
        let adaptive = Arc::new(Adaptive::new(
            engine.clone(),
            BatchSize {
                max_tasks: 4,
                max_rows: 64,
            },
            4,
            true,
            metrics.clone(),
        ));
        let tasks = TaskTracker::new();
        let abandon = CancellationToken::new();
        let shared = Arc::new(Shared {
            offsets: offsets.clone(),
            outcomes: Outcomes::new(OutcomeSettings {
                offsets: offsets.clone(),
                publisher: recorder.clone(),
                metrics: metrics.clone(),
                worker_id: "w".into(),
                group: "g".into(),
                retry: RetryPolicy::forever(Duration::from_millis(1)),
                abandon: abandon.clone(),
                tasks: tasks.clone(),
            }),
            redelivery: Arc::new(NeverStarted),
            crash_guard: CrashGuard::new(offsets.clone(), 0),
            running: Arc::default(),
            images: sink,
            serving: Arc::new(serving),
            adaptive: adaptive.clone(),
            metrics: metrics.clone(),
            worker_id: "w".into(),
            max_task_bytes: 1 << 20,
            catalog: Arc::new(sluice_schemas::Catalog::default()),
            storage_retry: RetryPolicy {
                max_attempts: 3,
                max_elapsed: Duration::from_secs(5),
                base_delay: Duration::from_millis(1),
                max_delay: Duration::from_millis(2),
            },
            abandon,
            finishing: Semaphore::new(8),
            tasks,
            progress: None,
            cancellations: Default::default(),
        });
        let (record_tx, record_rx) = mpsc::channel(256);
        let (job_tx, job_rx) = mpsc::channel(256);
        let (batcher, requests) = Batcher::new(job_rx, adaptive, Duration::from_millis(5));
        let stages = [
            tokio::spawn(decode(record_rx, job_tx, shared.clone())),
            tokio::spawn(batcher.run()),
            // One more batch at once than engine threads, as the worker runs it.
            tokio::spawn(super::engine(requests, shared.clone(), 3)),
        ];

        // 60 records: tasks of 1-3 images, a task whose model code panics, one it fails on, a
        // record that is not JSON and one over the size limit.
        let mut expected = BTreeMap::new();
        for offset in 0..60i64 {
            let (value, kind) = match offset {
                13 => (task(PANIC_SEED, 1), "dlq"),
                29 => (task(ERROR_SEED, 2), "dlq"),
                41 => (b"{not json".to_vec(), "dlq"),
                50 => (vec![b' '; (1 << 20) + 1], "dlq"),
                _ => (task(offset as u64, 1 + (offset % 3) as u32), "succeeded"),
            };
            expected.insert(offset, kind);
            record_tx.send(record(&offsets, &tp, offset, value)).await.unwrap();
        }
        drop(record_tx);
        for stage in stages {
            stage.await.unwrap();
        }
        shared.tasks.close();
        tokio::time::timeout(Duration::from_secs(30), shared.tasks.wait()).await.unwrap();

        let seen = recorder.seen.lock().unwrap().clone();
        // Every record has exactly one outcome of the expected kind (a failed task's DLQ record
        // comes with a failed completion; an undecodable record has no task to complete).
        for (offset, kind) in &expected {
            let outcomes: Vec<&str> = seen.iter().filter(|p| p.offset == *offset).map(|p| p.kind).collect();
            let want: &[&str] = match (*kind, *offset) {
                ("dlq", 41 | 50) => &["dlq"],
                ("dlq", _) => &["dlq", "failed"],
                _ => &["succeeded"],
            };
            assert_eq!(outcomes, want, "offset {offset}");
        }
        // They finished out of order...
        let order: Vec<i64> = seen.iter().map(|p| p.offset).collect();
        assert!(
            order.windows(2).any(|w| w[1] < w[0]),
            "outcomes in offset order: the test proves nothing"
        );
        // ...yet no record was acknowledged before its outcome was published, and no offset was
        // committable past an unfinished record.
        for p in &seen {
            assert!(p.pending, "acknowledged before its outcome was published: {p:?}");
            assert!(p.commit_at_publish.is_none_or(|c| c <= p.offset), "{p:?}");
        }
        assert_eq!(offsets.in_flight(), 0);
        let at_end: Vec<_> = offsets.commit_candidates().into_iter().map(|c| (c.tp, c.offset)).collect();
        assert_eq!(at_end, vec![(tp, 60)], "everything committable at the end");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
