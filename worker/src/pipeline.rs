//! The stages of one task's life, joined by bounded channels:
//!
//! ```text
//! source ─▶ decode ─▶ batcher ─▶ engine ─▶ finish (render, sink, publish) ─▶ offsets
//! ```
//!
//! Every task carries its origin; whichever stage finishes it (the DLQ from decode, a completion
//! after upload) acknowledges it in one place, [`Offsets`]. A task is acknowledged only after its
//! completion or DLQ record was acknowledged by the broker; a task abandoned at shutdown or on a
//! revoke is never acknowledged, so it is read again.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sluice_schemas::{CompletionError, CompletionEvent, CompletionStatus, DlqReason, OutputRef, SCHEMA_VERSION, Timings, decode_task};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::adaptive::{Adaptive, BatchItem, Done};
use crate::batcher::{Batch, BatchRequests};
use crate::encode::Image;
use crate::engine::{EngineError, Tensor};
use crate::events::{DeadLettered, Emit, TaskSucceeded};
use crate::metrics::Metrics;
use crate::models::{Bucket, ModelAdapter, Prepared};
use crate::offsets::Offsets;
use crate::publish::Publisher;
use crate::retry::{GaveUp, RetryPolicy, retry};
use crate::serving::Serving;
use crate::sink::Sink;
use crate::task::{Failure, Job, Record};

/// What every stage shares.
pub struct Shared {
    pub offsets: Arc<Offsets>,
    pub publisher: Publisher,
    pub sink: Sink,
    pub serving: Arc<Serving>,
    pub adaptive: Arc<Adaptive>,
    pub metrics: Metrics,
    pub worker_id: String,
    pub max_task_bytes: usize,
    /// Storage retries: bounded, then `retries_exhausted`.
    pub storage_retry: RetryPolicy,
    /// Broker retries: until cancelled (the offset is never committed without the record).
    pub publish_retry: RetryPolicy,
    /// Fires when the worker gives up on what is in flight (shutdown grace over, fatal error).
    pub abandon: CancellationToken,
    /// Bounds tasks being rendered and stored at once.
    pub finishing: Semaphore,
    /// Every spawned per-task future, so shutdown can wait for them.
    pub tasks: TaskTracker,
}

/// A prepared task inside a batch.
pub struct Item {
    job: Job,
    prepared: Prepared,
    adapter: Arc<dyn ModelAdapter>,
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
}

/// Decode: parse and validate each record; bad ones go to the DLQ at once, good ones whose
/// results already exist are announced again, the rest go to the batcher.
pub async fn decode(mut input: mpsc::Receiver<Record>, to_batcher: mpsc::Sender<(Bucket, Job)>, shared: Arc<Shared>) {
    while let Some(record) = input.recv().await {
        if !shared.offsets.should_start(&record.origin) {
            continue; // revoked or being revoked while queued; the new owner reads it again
        }
        if record.value.len() > shared.max_task_bytes {
            let failure = Failure::new(
                DlqReason::TooLarge,
                format!("record is {} bytes; the limit is {}", record.value.len(), shared.max_task_bytes),
            );
            shared.tasks.spawn(dead_letter(shared.clone(), record, failure, None));
            continue;
        }
        let task = match decode_task(&record.value, record.header(sluice_schemas::HEADER_SCHEMA_VERSION)) {
            Ok(task) => task,
            Err(bad) => {
                let mut failure = Failure::new(bad.error.reason(), bad.error.to_string());
                if let sluice_schemas::DecodeError::Schema(violations) = &bad.error {
                    let fields = violations
                        .iter()
                        .map(|v| serde_json::json!({"field": v.field, "message": v.message}))
                        .collect();
                    failure = failure.with_details([("violations".to_owned(), serde_json::Value::Array(fields))].into_iter().collect());
                }
                let identity = bad.task_id.map(|id| TaskIdentity {
                    task_id: id,
                    tenant: bad.tenant,
                    model: bad.model,
                    user: None,
                });
                shared.tasks.spawn(dead_letter(shared.clone(), record, failure, identity));
                continue;
            }
        };
        let span = tracing::info_span!("task", task_id = %task.task_id, partition = record.origin.partition, offset = record.origin.offset);
        let Some(adapter) = shared.serving.adapter(&task.model) else {
            let failure = Failure::new(
                DlqReason::UnsupportedModel,
                format!("model {:?} is not served here (serving {:?})", task.model, shared.serving.names()),
            );
            let identity = Some(TaskIdentity::of(&task));
            shared.tasks.spawn(dead_letter(shared.clone(), record, failure, identity));
            continue;
        };
        let bucket = match adapter.bucket(&task) {
            Ok(bucket) => bucket,
            Err(e) => {
                let identity = Some(TaskIdentity::of(&task));
                shared.tasks.spawn(dead_letter(
                    shared.clone(),
                    record,
                    Failure::new(DlqReason::SchemaViolation, e),
                    identity,
                ));
                continue;
            }
        };
        let job = Job { record, task, span };
        // The idempotency check is a storage round trip: run it concurrently, not in line.
        let (shared2, to_batcher) = (shared.clone(), to_batcher.clone());
        if !job.record.check {
            // New since the last read lease: no earlier delivery can have results.
            let _ = to_batcher.send((bucket, job)).await;
            continue;
        }
        shared.tasks.spawn(async move {
            if let Some(job) = announce_if_done(&shared2, job).await {
                let _ = to_batcher.send((bucket, job)).await;
            }
        });
    }
}

/// If an earlier attempt finished the task (its manifest exists), publishes its completion
/// again from the manifest and acknowledges it; otherwise hands the job back.
async fn announce_if_done(shared: &Arc<Shared>, job: Job) -> Option<Job> {
    let task_id = job.task.task_id;
    let manifest = retry(shared.storage_retry, "manifest_check", &shared.metrics, &shared.abandon, || {
        shared.sink.manifest(task_id)
    })
    .await;
    let manifest = match manifest {
        Ok(Some(m)) => m,
        Ok(None) => return Some(job),
        Err(GaveUp::Cancelled) => return None,
        Err(GaveUp::Exhausted {
            error,
            attempts,
            first_failed_at,
        }) => {
            let failure = Failure {
                reason: DlqReason::RetriesExhausted,
                message: format!("checking for earlier results: {error}"),
                details: None,
                attempts,
                first_failed_at,
            };
            let identity = Some(TaskIdentity::of(&job.task));
            dead_letter(shared.clone(), job.record, failure, identity).await;
            return None;
        }
    };
    let started = Instant::now();
    let timings = Timings {
        total_ms: job.age_ms(Utc::now()),
        inference_ms: manifest.inference_ms.unwrap_or(0),
        ..Timings::default()
    };
    let event = completion_event(shared, &job, manifest.outputs, timings, None);
    if publish_completion(shared, &event).await {
        TaskSucceeded {
            task_id: &task_id.to_string(),
            images: event.outputs.len(),
            total: started.elapsed(),
            upload: Duration::ZERO,
            duplicate: true,
        }
        .emit(&shared.metrics);
        shared.offsets.ack(&job.record.origin);
    }
    None
}

/// The engine stage: pulls batches and runs up to `concurrency` of them at once (one more than
/// the engine slots, so the next batch is prepared while one runs).
pub async fn engine(requests: BatchRequests<Job>, shared: Arc<Shared>, concurrency: usize) {
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
    let jobs: Vec<Job> = items
        .into_iter()
        .filter(|j| shared.offsets.should_start(&j.record.origin))
        .collect();
    if jobs.is_empty() {
        return;
    }
    let Some(adapter) = shared.serving.adapter(&bucket.model) else {
        return;
    };
    // Prepare on the blocking pool: noise and tiling are CPU work.
    let prepared = {
        let adapter = adapter.clone();
        tokio::task::spawn_blocking(move || jobs.into_iter().map(|job| (adapter.prepare(&job.task), job)).collect::<Vec<_>>())
            .await
            .expect("prepare does not panic")
    };
    let mut items = Vec::with_capacity(prepared.len());
    for (result, job) in prepared {
        match result {
            Ok(prepared) => items.push(Item {
                job,
                prepared,
                adapter: adapter.clone(),
            }),
            Err(e) => {
                let identity = Some(TaskIdentity::of(&job.task));
                shared.tasks.spawn(dead_letter(
                    shared.clone(),
                    job.record,
                    Failure::new(DlqReason::ModelError, e),
                    identity,
                ));
            }
        }
    }
    let Some(_held) = shared.serving.hold(&bucket.model).await else {
        tracing::error!(model = %bucket.model, "model is not loaded; leaving its tasks for a restarted worker");
        return;
    };
    shared
        .adaptive
        .run(&bucket, items, |done| match done {
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
                let Some(failure) = failure_of(&item, &bucket, &error) else {
                    return;
                };
                let identity = Some(TaskIdentity::of(&item.job.task));
                shared.tasks.spawn(dead_letter(shared.clone(), item.job.record, failure, identity));
            }
        })
        .await;
}

fn failure_of(item: &Item, bucket: &Bucket, error: &EngineError) -> Option<Failure> {
    let mut details = item.adapter.describe(&item.job.task);
    details.insert("rows".into(), bucket.rows_per_task.into());
    let failure = match error {
        EngineError::OutOfMemory(m) => Failure::new(
            DlqReason::ResourceExhausted,
            format!("out of memory even at batch 1 ({}): {m}", item.dimensions()),
        ),
        EngineError::Run(m) | EngineError::Load(m) => Failure::new(DlqReason::ModelError, m.clone()),
        EngineError::Runtime(_) | EngineError::Stopped => return None, // not the task's fault: leave it for redelivery
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

/// Render, store, announce, acknowledge.
async fn finish(shared: Arc<Shared>, item: Item, ran: Ran) {
    let _permit = shared.finishing.acquire().await.expect("never closed");
    let Item { job, prepared, adapter } = item;
    let (images, job) = {
        let task = job.task.clone();
        let outputs = ran.outputs.clone();
        let rows = ran.rows.clone();
        let rendered = tokio::task::spawn_blocking(move || adapter.render(&task, &prepared, &outputs, rows))
            .await
            .expect("render does not panic");
        (rendered, job)
    };
    let images: Vec<Image> = match images {
        Ok(images) => images,
        Err(e) => {
            let identity = Some(TaskIdentity::of(&job.task));
            return dead_letter(
                shared.clone(),
                job.record,
                Failure::new(DlqReason::ModelError, format!("rendering: {e}")),
                identity,
            )
            .await;
        }
    };
    let upload_started = Instant::now();
    let task_id = job.task.task_id;
    let stored = retry(shared.storage_retry, "upload", &shared.metrics, &shared.abandon, || async {
        let puts = images
            .iter()
            .enumerate()
            .map(|(i, image)| shared.sink.put_image(task_id, i as u32, image));
        let outputs: Vec<OutputRef> = futures::future::try_join_all(puts).await?;
        shared
            .sink
            .put_manifest(task_id, &outputs, ran.inference.as_millis() as u64, &shared.worker_id)
            .await?;
        Ok::<_, crate::sink::SinkError>(outputs)
    })
    .await;
    let outputs = match stored {
        Ok(outputs) => outputs,
        Err(GaveUp::Cancelled) => return,
        Err(GaveUp::Exhausted {
            error,
            attempts,
            first_failed_at,
        }) => {
            let failure = Failure {
                reason: DlqReason::RetriesExhausted,
                message: format!("storing images: {error}"),
                details: None,
                attempts,
                first_failed_at,
            };
            let identity = Some(TaskIdentity::of(&job.task));
            return dead_letter(shared.clone(), job.record, failure, identity).await;
        }
    };
    let upload = upload_started.elapsed();
    let now = Utc::now();
    let timings = Timings {
        queued_ms: (ran.started_at - job.task.submitted_at).num_milliseconds().max(0) as u64,
        inference_ms: ran.inference.as_millis() as u64,
        upload_ms: upload.as_millis() as u64,
        total_ms: job.age_ms(now),
    };
    let event = completion_event(&shared, &job, outputs, timings, None);
    if publish_completion(&shared, &event).await {
        TaskSucceeded {
            task_id: &task_id.to_string(),
            images: event.outputs.len(),
            total: Duration::from_millis(timings.total_ms),
            upload,
            duplicate: false,
        }
        .emit(&shared.metrics);
        tracing::debug!(batch_size = ran.batch_size, "completed");
        shared.offsets.ack(&job.record.origin);
    }
}

/// Who a task is, for its completion event; what is known of a record that failed to decode.
pub struct TaskIdentity {
    task_id: uuid::Uuid,
    tenant: Option<String>,
    model: Option<String>,
    user: Option<String>,
}

impl TaskIdentity {
    fn of(task: &sluice_schemas::TaskRecord) -> TaskIdentity {
        TaskIdentity {
            task_id: task.task_id,
            tenant: Some(task.tenant.clone()),
            model: Some(task.model.clone()),
            user: task.user.clone(),
        }
    }
}

fn completion_event(
    shared: &Shared,
    job: &Job,
    outputs: Vec<OutputRef>,
    timings: Timings,
    error: Option<CompletionError>,
) -> CompletionEvent {
    CompletionEvent {
        version: SCHEMA_VERSION,
        task_id: job.task.task_id,
        status: if error.is_some() {
            CompletionStatus::Failed
        } else {
            CompletionStatus::Succeeded
        },
        model: job.task.model.clone(),
        tenant: job.task.tenant.clone(),
        user: job.task.user.clone(),
        outputs,
        error,
        timings,
        worker_id: shared.worker_id.clone(),
        attempt: job.record.attempt(),
        completed_at: Utc::now(),
        source: job.record.origin.source_ref(),
    }
}

/// Publishes until acknowledged; false when abandoned (shutdown), so the caller must not ack.
async fn publish_completion(shared: &Shared, event: &CompletionEvent) -> bool {
    retry(shared.publish_retry, "publish_completion", &shared.metrics, &shared.abandon, || {
        shared.publisher.completion(event)
    })
    .await
    .is_ok()
}

/// Sends a record to the DLQ, announces the failure on the completion topic when the task is
/// known, then acknowledges the record.
pub async fn dead_letter(shared: Arc<Shared>, record: Record, failure: Failure, identity: Option<TaskIdentity>) {
    let task_id = identity.as_ref().map(|i| i.task_id);
    let sent = retry(shared.publish_retry, "publish_dlq", &shared.metrics, &shared.abandon, || {
        shared.publisher.dead_letter(&record, &failure, task_id)
    })
    .await;
    if sent.is_err() {
        return; // abandoned: not acknowledged, read again after restart
    }
    if let Some(identity) = identity {
        let event = CompletionEvent {
            version: SCHEMA_VERSION,
            task_id: identity.task_id,
            status: CompletionStatus::Failed,
            model: identity.model.unwrap_or_default(),
            tenant: identity.tenant.unwrap_or_default(),
            user: identity.user,
            outputs: Vec::new(),
            error: Some(CompletionError {
                reason: failure.reason,
                message: failure.message.clone(),
            }),
            timings: Timings {
                total_ms: record.received_at.elapsed().as_millis() as u64,
                ..Timings::default()
            },
            worker_id: shared.worker_id.clone(),
            attempt: record.attempt(),
            completed_at: Utc::now(),
            source: record.origin.source_ref(),
        };
        if !publish_completion(&shared, &event).await {
            return;
        }
    }
    DeadLettered {
        reason: failure.reason,
        task_id: task_id.map(|t| t.to_string()),
        message: &failure.message,
        partition: record.origin.partition,
        offset: record.origin.offset,
    }
    .emit(&shared.metrics);
    shared.offsets.ack(&record.origin);
}

/// Refreshes the gauges that are read rather than counted.
pub async fn gauges(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.is_cancelled() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let m = &shared.metrics;
        m.observe_offsets(&shared.offsets);
        m.oldest_in_flight_seconds
            .set(shared.offsets.oldest_age().map_or(0.0, |d| d.as_secs_f64()));
        m.rss_bytes.set(crate::metrics::rss_bytes() as i64);
        if let Some(arena) = shared.adaptive.engine().runtime().cpu_arena_stats() {
            m.arena_in_use_bytes.set(arena.in_use as i64);
            m.arena_allocated_bytes.set(arena.total_allocated as i64);
        }
    }
}
