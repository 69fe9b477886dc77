//! The engine stage: batches from the batcher, their tasks still wanted and prepared, run
//! through the adaptive batcher; what ran goes on to [`super::finish`], what failed to its
//! outcome.

use std::sync::Arc;

use chrono::Utc;
use sluice_schemas::{CompletionStatus, DlqReason};
use tracing::Instrument;

use crate::batching::adaptive::{BatchItem, Done, Joining};
use crate::batching::batcher::{Batch, BatchRequests, Joins};
use crate::engine::EngineError;
use crate::models::{Bucket, ModelError};
use crate::outcome::failure::Failure;
use crate::panics;
use crate::pipeline::task::Job;

use super::finish::{Ran, finish};
use super::{EngineStage, Item};

/// The engine stage: pulls batches and runs each on a task of its own; the batcher hands out
/// only as many at once as its [`crate::batching::batcher::Admission`] allows (one more than
/// the engine slots, so the next batch is prepared while one runs, and more of other buckets).
pub(crate) async fn engine(requests: BatchRequests<Job>, stage: Arc<EngineStage>) {
    while let Some(batch) = requests.next().await {
        let stage2 = stage.clone();
        stage.tasks.spawn(async move { run_batch(&stage2, batch).await });
    }
}

async fn run_batch(stage: &EngineStage, batch: Batch<Job>) {
    // `_out` is held to the end: the batcher counts the batch out until then.
    let Batch {
        bucket,
        items,
        out: _out,
        joins,
    } = batch;
    let jobs = still_wanted(stage, items);
    if jobs.is_empty() {
        return;
    }
    let Some(items) = prepare(stage, &bucket, jobs).await else {
        return;
    };
    let Some(_held) = stage.serving.hold(&bucket.model).await else {
        tracing::error!(model = %bucket.model, "model is not loaded; leaving its tasks for a restarted worker");
        return;
    };
    // Before the call (durably for a record an earlier owner may have started): should it kill
    // the process, the next owner knows what ran.
    let _alone = match bucket.alone {
        Some(_) => Some(stage.crash_guard.alone().await),
        None => None,
    };
    record_starts(stage, &items).await;
    let mut joiner = Joiner {
        stage,
        bucket: &bucket,
        joins,
    };
    stage
        .adaptive
        .run_joined(&bucket, items, Some(&mut joiner), |done| on_done(stage, &bucket, done))
        .await;
}

/// The tasks that join a running batch at a step boundary, as the batch's own were made
/// ready: still wanted, prepared, and marked started with the crash guard before they run.
struct Joiner<'a> {
    stage: &'a EngineStage,
    bucket: &'a Bucket,
    joins: Joins<Job>,
}

impl Joining<Item> for Joiner<'_> {
    fn more(&mut self, room: usize) -> futures::future::BoxFuture<'_, Vec<Item>> {
        Box::pin(async move {
            let jobs = still_wanted(self.stage, self.joins.take(room).await);
            if jobs.is_empty() {
                return Vec::new();
            }
            let Some(items) = prepare(self.stage, self.bucket, jobs).await else {
                return Vec::new();
            };
            record_starts(self.stage, &items).await;
            items
        })
    }
}

/// Before their model call (durably for records an earlier owner may have started): should it
/// kill the process, the next owner knows what ran (the crash guard).
async fn record_starts(stage: &EngineStage, items: &[Item]) {
    let origins: Vec<&crate::source::record::Origin> = items.iter().map(|i| &i.job.record.origin).collect();
    stage.crash_guard.starting(&origins).await;
}

/// The jobs of a batch that are still to run: not from a partition this worker lost, not
/// cancelled while queued, not past their deadline (those two are announced as such, unrun).
fn still_wanted(stage: &EngineStage, jobs: Vec<Job>) -> Vec<Job> {
    let mut wanted = Vec::with_capacity(jobs.len());
    for job in jobs {
        if !stage.offsets.keep_or_release(&job.record.origin) {
            continue; // revoked, or released by a draining partition
        }
        let ended = if stage.cancellations.contains(&job.task.task_id) {
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
                let outcomes = stage.outcomes.clone();
                stage.tasks.spawn(async move { outcomes.ended(&job, status).await });
            }
            None => wanted.push(job),
        }
    }
    wanted
}

/// The job with its input images read from the input store and checked against their hashes,
/// or `None` after failing it (no input store here, a missing or altered image, the store
/// unreachable past the retry policy). Read here, just before the task runs, so that tasks
/// waiting in the batcher hold only their records.
async fn read_inputs(stage: &EngineStage, mut job: Job) -> Option<Job> {
    let request = &job.task.request;
    let Some(init) = request.init_image.clone() else {
        return Some(job);
    };
    let Some(inputs) = &stage.finish.store.inputs else {
        let message = "the task has input images and this worker reads none (SLUICE_INPUT_URL is not set)";
        stage.outcomes.fail(job, Failure::new(DlqReason::StorageRejected, message));
        return None;
    };
    let mask = request.mask_image.clone();
    for (field, image) in [("init_image", Some(init)), ("mask_image", mask)] {
        let Some(image) = image else { continue };
        match stage.finish.store.run("input_read", || inputs.input(&image)).await {
            Ok(bytes) if field == "init_image" => job.inputs.init = Some(bytes),
            Ok(bytes) => job.inputs.mask = Some(bytes),
            Err(gave_up) => {
                stage.outcomes.gave_up(job, &format!("reading the {field} {}", image.key), gave_up);
                return None;
            }
        }
    }
    Some(job)
}

/// The jobs' model inputs, made on the blocking pool (noise and tiling are CPU work), each task
/// on its own: one that fails (or panics) goes to the DLQ and the others run. `None` when the
/// model is gone or the runtime is shutting down: the tasks stay unacknowledged (also when no
/// task is left once the input images are read).
async fn prepare(stage: &EngineStage, bucket: &Bucket, jobs: Vec<Job>) -> Option<Vec<Item>> {
    let jobs: Vec<Job> = futures::future::join_all(jobs.into_iter().map(|job| read_inputs(stage, job)))
        .await
        .into_iter()
        .flatten()
        .collect();
    if jobs.is_empty() {
        return None;
    }
    let adapter = stage.serving.adapter(&bucket.model)?;
    let steps: Vec<Option<u32>> = jobs.iter().map(|j| adapter.steps(&j.task)).collect();
    let prepared = tokio::task::spawn_blocking(move || {
        jobs.into_iter()
            .map(|job| {
                (
                    panics::catch(|| adapter.prepare(&job.task, &job.inputs))
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
                // A task carrying on from its step checkpoint starts at the step it reached, of
                // the steps its bucket runs (as its step records count them).
                let first = bucket.key.steps().map_or(0, |s| s.steps.start);
                let from = job.resume.as_ref().map_or(0, |r| r.step.saturating_sub(first) as u32);
                let progress = steps.zip(stage.progress.as_ref()).map(|(steps, sink)| {
                    Arc::new(
                        sink.start(
                            job.task.task_id,
                            &bucket.model,
                            (from, steps),
                            crate::outcome::publish::TraceHeaders::of(&job.record),
                        )
                        .with_handoff(stage.offsets.clone(), job.record.origin.clone()),
                    )
                });
                items.push(Item { job, prepared, progress })
            }
            Err(e) => stage.outcomes.fail(job, Failure::new(DlqReason::ModelError, e.to_string())),
        }
    }
    Some(items)
}

/// What the adaptive batcher reports of a call: each task that ran is rendered, stored and
/// announced on a task of its own; one that failed goes to its outcome.
fn on_done(stage: &EngineStage, bucket: &Bucket, done: Done<Item>) {
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
                // Out of the model call: a kill during render or upload is no crash of its.
                stage.offsets.call_ended(&item.job.record.origin);
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
                stage.tasks.spawn(finish(stage.finish.clone(), item, ran).instrument(span));
            }
        }
        Done::Failed { item, error } => {
            stage.offsets.call_ended(&item.job.record.origin);
            if let Some(failure) = failure_of(stage, &item, bucket, &error) {
                stage.outcomes.fail(item.job, failure);
            }
        }
    }
}

/// The DLQ failure of a task that failed on its own; `None` for an engine failure that is not
/// the task's fault (it is left for redelivery).
fn failure_of(stage: &EngineStage, item: &Item, bucket: &Bucket, error: &EngineError) -> Option<Failure> {
    let mut details = stage
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
