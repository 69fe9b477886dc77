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
use crate::panics;
use crate::pipeline::task::Failure;
use crate::retry::retry;

use super::{Item, Shared};

pub(super) struct Ran {
    pub(super) outputs: Arc<Vec<Tensor>>,
    pub(super) rows: Range<usize>,
    pub(super) inference: Duration,
    pub(super) started_at: chrono::DateTime<Utc>,
    pub(super) batch_size: usize,
}

/// Render, store, announce.
pub(super) async fn finish(shared: Arc<Shared>, item: Item, ran: Ran) {
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
