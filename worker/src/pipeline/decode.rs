//! The decode stage: each record parsed and admitted (or failed at once with its reason),
//! looked up for earlier results when it may have run before, and given the crash guard's
//! verdict; what may run goes to the batcher.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sluice_schemas::{DlqReason, Timings, decode_task};
use tokio::sync::mpsc;

use crate::events::{self, Emit};
use crate::models::{Bucket, ModelError};
use crate::outcome::failure::Failure;
use crate::outcome::{Failed, Success, TaskIdentity};
use crate::panics;
use crate::pipeline::task::Job;
use crate::source::crash_guard::Verdict;
use crate::source::record::Record;
use crate::storage::checkpoints::{CheckpointStore, Owner};

use super::DecodeStage;

/// Decode: parse and validate each record; bad ones fail at once, good ones that may have been
/// started before are checked for results, the rest go to the batcher.
pub(crate) async fn decode(mut input: mpsc::Receiver<Record>, to_batcher: mpsc::Sender<(Bucket, Job)>, stage: Arc<DecodeStage>) {
    while let Some(record) = input.recv().await {
        if !stage.offsets.keep_or_release(&record.origin) {
            continue; // revoked or being revoked while queued; the new owner reads it again
        }
        // Before anything of the partition can be committed, a record that fails at once
        // included (a partition holding only those would otherwise never be).
        stage.redelivery.know_partition(&record.origin).await;
        if stage.offsets.announced_ahead(&record.origin) {
            // Finished ahead of the position by an earlier owner, its outcome announced in the
            // commit that recorded it: neither run nor announced again.
            tracing::debug!(
                partition = record.origin.partition,
                offset = record.origin.offset,
                "announced by an earlier owner; skipped"
            );
            stage.offsets.ack(&record.origin);
            continue;
        }
        let Some((bucket, mut job)) = admit(&stage, record) else {
            continue;
        };
        // Whether a checkpoint may fall due before its last step (else none is ever written):
        // after a multiple of `checkpoint_every` steps, or by time after any step but the last.
        job.checkpointed = bucket.key.steps().is_some_and(|s| {
            s.checkpoint_every.is_some_and(|every| s.steps.len() > every) || (s.checkpoint_seconds.is_some() && s.steps.len() > 1)
        });
        let replayed = job.record.header(sluice_schemas::HEADER_ORIGIN).is_some();
        // A task submitted with an Idempotency-Key may have been published twice (two producer
        // replicas, a retry while one caught up): its results may exist already.
        let check = stage.redelivery.admit(&job.record.origin, replayed).await || job.task.idempotency.is_some();
        let current = |o: &crate::source::record::Origin| stage.offsets.is_current(o);
        let earlier = match stage.running.claim(job.task.task_id, &job.record.origin, current) {
            Ok(claim) => {
                job.claim = Some(claim);
                false
            }
            Err(_) => true, // another record of this task is in flight here
        };
        if !check && !earlier {
            // No earlier delivery can have started it: no results to look for.
            if let Some((bucket, job)) = guard(&stage, bucket, job) {
                let _ = to_batcher.send((bucket, job)).await;
            }
            continue;
        }
        // The check is a storage round trip (after the earlier record of the same task, if one
        // is in flight): run it concurrently, not in line.
        let (stage2, to_batcher) = (stage.clone(), to_batcher.clone());
        stage.tasks.spawn(async move {
            if earlier {
                let current = |o: &crate::source::record::Origin| stage2.offsets.is_current(o);
                job.claim = Some(
                    stage2
                        .running
                        .claim_after_others(job.task.task_id, &job.record.origin, current)
                        .await,
                );
            }
            let Some(job) = announce_if_done(&stage2, job).await else {
                return;
            };
            let job = resume_from_checkpoint(&stage2, &bucket, job).await;
            if let Some((bucket, job)) = guard(&stage2, bucket, job) {
                let _ = to_batcher.send((bucket, job)).await;
            }
        });
    }
}

/// A task of a bucket that keeps checkpoints, that may have run before and has no results: it
/// carries on from its latest checkpoint that reads back as its own and fits its bucket (its
/// rows, a step the bucket runs). Checkpoints that cannot be read leave it to start from its
/// first step, with a WARN: they save time, they are never needed.
async fn resume_from_checkpoint(stage: &DecodeStage, bucket: &Bucket, mut job: Job) -> Job {
    let Some(steps) = bucket.key.steps().filter(|_| job.checkpointed).map(|s| s.steps.clone()) else {
        return job;
    };
    let owner = Owner {
        task_id: job.task.task_id,
        attempt: job.record.attempt(),
        model: bucket.model.clone(),
        bucket: bucket.key.name().to_owned(),
    };
    let found = CheckpointStore::new(stage.store.images.clone(), stage.store.metrics.clone())
        .latest(&owner)
        .await
        .map(|(resume, stored)| {
            job.checkpoints_stored = stored;
            resume
        });
    match found {
        Ok(Some(resume)) => {
            let fits =
                steps.start < resume.step && resume.step < steps.end && resume.carried.iter().all(|t| t.rows() == bucket.rows_per_task);
            if fits {
                events::CarriedOn {
                    span: &job.span,
                    step: resume.step,
                    saved: resume.step - steps.start,
                }
                .emit(&stage.store.metrics);
                job.resume = Some(resume);
            } else {
                tracing::warn!(parent: &job.span, step = resume.step, "a checkpoint that does not fit the task's bucket; starting from the first step");
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(parent: &job.span, error = %e, "checkpoints could not be read; starting from the first step"),
    }
    job
}

/// The crash guard's verdict on a task with no earlier results: it runs (alone, when an earlier
/// worker started it and died), or goes to the DLQ after `SLUICE_MAX_CRASHES` such starts that
/// made no progress (each step checkpoint stored is a start's progress).
fn guard(stage: &DecodeStage, bucket: Bucket, job: Job) -> Option<(Bucket, Job)> {
    let origin = &job.record.origin;
    match stage.crash_guard.verdict(origin, job.checkpoints_stored) {
        Verdict::Run => Some((bucket, job)),
        Verdict::Alone { starts } => {
            tracing::warn!(parent: &job.span, starts, "started before by a worker that stopped before it finished; running it alone");
            let alone = Some((origin.partition, origin.offset));
            Some((Bucket { alone, ..bucket }, job))
        }
        Verdict::Crashed { starts } => {
            let message = format!(
                "started {starts} times without an outcome or a new step checkpoint: each start ended the \
                 worker that ran it (an abort, a crash in native code or an OOM kill; SLUICE_MAX_CRASHES)"
            );
            tracing::error!(parent: &job.span, starts, "a record that keeps killing workers goes to the DLQ");
            stage.outcomes.fail(job, Failure::new(DlqReason::Crashed, message));
            None
        }
    }
}

/// The job and bucket of a record, or `None` after failing it (too large, undecodable, a model
/// not served here, parameters its model refuses).
fn admit(stage: &DecodeStage, record: Record) -> Option<(Bucket, Job)> {
    let job = job_of(stage, record)?;
    bucket_of(stage, job)
}

/// The job of a record, or `None` after failing it (too large, undecodable).
fn job_of(stage: &DecodeStage, record: Record) -> Option<Job> {
    let outcomes = &stage.outcomes;
    if record.value.len() > stage.max_task_bytes {
        let failure = Failure::new(
            DlqReason::TooLarge,
            format!("record is {} bytes; the limit is {}", record.value.len(), stage.max_task_bytes),
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
    Some(Job {
        record,
        task,
        span,
        claim: None,
        inputs: Default::default(),
        checkpointed: false,
        resume: None,
        checkpoints_stored: 0,
    })
}

/// The bucket of a job, or `None` after failing it (a model not served here, work over its
/// catalog bounds, parameters its model refuses).
fn bucket_of(stage: &DecodeStage, job: Job) -> Option<(Bucket, Job)> {
    let outcomes = &stage.outcomes;
    let Some(adapter) = stage.serving.adapter(&job.task.model) else {
        let failure = Failure::new(
            DlqReason::UnsupportedModel,
            format!(
                "model {:?} is not served here (serving {:?})",
                job.task.model,
                stage.serving.names()
            ),
        );
        outcomes.fail(job, failure);
        return None;
    };
    // The bounds of one task's work, as the producer checks them: a record can reach the topic
    // without the producer, and one oversized task must not take the worker's memory.
    if let Some(entry) = stage.catalog.get(&job.task.model) {
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
async fn announce_if_done(stage: &DecodeStage, job: Job) -> Option<Job> {
    let task_id = job.task.task_id;
    let manifest = stage.store.run("manifest_check", || stage.store.images.manifest(task_id)).await;
    let manifest = match manifest {
        Ok(Some(m)) => m,
        Ok(None) => return Some(job),
        Err(gave_up) => {
            stage.outcomes.gave_up(job, "checking for earlier results", gave_up);
            return None;
        }
    };
    // Results of another request that used the same Idempotency-Key (raced past the producer's
    // check, or sent after its view forgot the first): never announced as this one's.
    if let (Some(idem), Some(theirs)) = (&job.task.idempotency, &manifest.request_sha256)
        && *theirs != idem.request_sha256
    {
        let message = format!(
            "Idempotency-Key {:?} was used for another request (hash {theirs}), whose results this task id holds; this request (hash {}) was not run",
            idem.key, idem.request_sha256
        );
        tracing::warn!(parent: &job.span, "an idempotency key reused for another request goes to the DLQ");
        stage.outcomes.fail(job, Failure::new(DlqReason::IdempotencyConflict, message));
        return None;
    }
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
    stage.outcomes.succeed(&job, success).await;
    None
}
