//! The finish stage: a task's rows of a call's outputs rendered to images, stored, and its
//! outcome announced.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sluice_schemas::{CompletionStatus, DlqReason, OutputRef, Timings};

use crate::engine::Tensor;
use crate::models::ModelError;
use crate::outcome::Success;
use crate::outcome::failure::Failure;
use crate::panics;
use crate::storage::checkpoints::CheckpointStore;

use super::{FinishStage, Item};

pub(super) struct Ran {
    pub(super) outputs: Arc<Vec<Tensor>>,
    pub(super) rows: Range<usize>,
    pub(super) inference: Duration,
    pub(super) started_at: chrono::DateTime<Utc>,
    pub(super) batch_size: usize,
}

/// Render, store, announce.
pub(super) async fn finish(stage: Arc<FinishStage>, item: Item, ran: Ran) {
    let _permit = stage.permits.acquire().await.expect("never closed");
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
            stage.outcomes.ended(&job, CompletionStatus::Cancelled).await;
            return;
        }
        Ok(Err(e)) => {
            stage
                .outcomes
                .fail(job, Failure::new(DlqReason::ModelError, format!("rendering: {e}")));
            return;
        }
        Err(_) => return, // the runtime is shutting down
    };
    let upload_started = Instant::now();
    let task_id = job.task.task_id;
    let store = &stage.store.images;
    let stored = stage
        .store
        .run("upload", || async {
            let puts = images
                .iter()
                .enumerate()
                .map(|(i, image)| store.put_image(task_id, i as u32, image));
            let outputs: Vec<OutputRef> = futures::future::try_join_all(puts).await?;
            store
                .put_manifest(
                    task_id,
                    &outputs,
                    ran.inference.as_millis() as u64,
                    &stage.worker_id,
                    job.task.idempotency.as_ref().map(|i| i.request_sha256.as_str()),
                )
                .await?;
            Ok::<_, crate::storage::images::StorageError>(outputs)
        })
        .await;
    let outputs = match stored {
        Ok(outputs) => outputs,
        Err(gave_up) => return stage.outcomes.gave_up(job, "storing images", gave_up),
    };
    if job.checkpointed {
        // The manifest supersedes the task's checkpoints: a later owner announces its results.
        let checkpoints = CheckpointStore::new(store.clone(), stage.store.metrics.clone());
        tokio::spawn(async move {
            if let Err(e) = checkpoints.delete(task_id).await {
                tracing::warn!(%task_id, error = %e, "the task's checkpoints could not be deleted (the lifecycle rule will)");
            }
        });
    }
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
    if stage.outcomes.succeed(&job, success).await {
        tracing::debug!(batch_size = ran.batch_size, "completed");
    }
}
