//! Starting role four: the pipeline. Builds what the stages share and starts them — the poll
//! thread (source), decode, the batcher, the engine stage, the committer and the gauges — joined
//! by bounded channels, as the diagram in [`crate::pipeline`] shows.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::kafka::{self, Clients};
use super::load::Loaded;
use super::{Setup, StartError};
use crate::batching::adaptive::{Adaptive, BatchSize};
use crate::batching::batcher::{Admission, Batcher};
use crate::config::DeliveryMode;
use crate::models::serving::Rebuild;
use crate::outcome::progress::{self, ProgressSink};
use crate::outcome::publish::{Destination, Publisher};
use crate::outcome::{OutcomeSettings, Outcomes};
use crate::pipeline::{self, DecodeStage, EngineStage, FinishStage, RetriedStore};
use crate::retry::RetryPolicy;
use crate::source::commit::commit_loop;
use crate::source::crash_guard::CrashGuard;
use crate::source::redelivery::CommitMetadataLeases;
use crate::source::{self, SourceControl};
use crate::storage::checkpoints::CheckpointStore;

/// The running stages, as the drain needs them.
pub(super) struct Stages {
    /// The stages' contexts, dropped after the drain (they hold Kafka clients).
    pub decode: Arc<DecodeStage>,
    pub engine: Arc<EngineStage>,
    /// Every spawned per-task future, so the drain can wait for them.
    pub tasks: TaskTracker,
    pub control: SourceControl,
    pub poll_thread: JoinHandle<()>,
    /// Decode, batcher and engine: each ends once its input channel is closed and empty.
    pub stages: Vec<tokio::task::JoinHandle<()>>,
    pub commit_loop: tokio::task::JoinHandle<()>,
    pub gauges_stop: CancellationToken,
    /// Fired when the grace period is over: what is still in flight is given up.
    pub abandon: CancellationToken,
}

pub(super) async fn start(setup: &Setup<'_>, loaded: &Loaded, clients: &Clients) -> Result<Stages, StartError> {
    let Setup {
        config,
        metrics,
        fatal,
        worker_id,
    } = *setup;
    let (b, d) = (&config.batching, &config.delivery);
    // Cancelled when the worker drains: reading stops, and checkpointed tasks keep their state
    // after every step until they finish or are given up.
    let stop_reading = CancellationToken::new();
    let adaptive = Arc::new(adaptive(setup, loaded, clients).await?.with_drain(stop_reading.clone()));
    let abandon = CancellationToken::new();
    let (decode, engine) = contexts(setup, loaded, clients, adaptive.clone(), &abandon)?;
    let (decode, engine) = (Arc::new(decode), Arc::new(engine));
    // Cancels first: a task cancelled while queued must not run because this worker joined the
    // group before it read the cancel.
    if !engine.cancellations.caught_up(crate::source::cancellations::CATCH_UP).await {
        tracing::warn!("the control topic was not read to its end in time; starting anyway (a cancel not read yet may be missed)");
    }

    // Each task topic has a window of `max_in_flight` of its own (`source::poll`).
    let windows = config.kafka.task_topics().all().len();
    let (record_tx, record_rx) = mpsc::channel(d.max_in_flight * windows * 2 + 16);
    let (job_tx, job_rx) = mpsc::channel(d.max_in_flight * windows + 16);
    let (batcher, requests) = Batcher::new(
        job_rx,
        adaptive,
        Duration::from_millis(b.max_wait_ms),
        Admission::for_slots(loaded.engine.shared_slots()),
    );
    let batcher = batcher.with_tenant_weights(b.tenant_weights.clone());
    let control = SourceControl {
        stop_reading,
        close: CancellationToken::new(),
        fatal: fatal.clone(),
    };
    let poll_thread = {
        let (consumer, offsets, control, metrics) = (clients.consumer.clone(), clients.offsets.clone(), control.clone(), metrics.clone());
        let max = d.max_in_flight;
        std::thread::Builder::new()
            .name("sluice-source".into())
            .spawn(move || source::poll_loop(consumer, offsets, record_tx, control, max, metrics))
            .map_err(StartError::Thread)?
    };
    if let Some(member) = kafka::orphan_repair_member(config, worker_id) {
        let (consumer, close, metrics) = (clients.consumer.clone(), control.close.clone(), metrics.clone());
        let topics = config.kafka.task_topics().names();
        let (group, drain) = (config.kafka.group_id.clone(), d.drain_timeout());
        std::thread::Builder::new()
            .name("sluice-orphans".into())
            .spawn(move || source::orphans::watch(consumer, member, group, topics, drain, close, metrics))
            .map_err(StartError::Thread)?;
    }
    let stages = vec![
        tokio::spawn(pipeline::decode(record_rx, job_tx, decode.clone())),
        tokio::spawn(batcher.run()),
        tokio::spawn(pipeline::engine(requests, engine.clone())),
    ];
    let commit_loop = tokio::spawn(commit_loop(
        clients.committer.clone(),
        clients.consumer.clone(),
        clients.offsets.clone(),
        d.commit_interval(),
        d.transaction_interval(),
        metrics.clone(),
        control.close.clone(),
    ));
    let gauges_stop = CancellationToken::new();
    tokio::spawn(pipeline::gauges(
        clients.offsets.clone(),
        loaded.serving.clone(),
        metrics.clone(),
        gauges_stop.clone(),
    ));
    let tasks = engine.tasks.clone();
    Ok(Stages {
        decode,
        engine,
        tasks,
        control,
        poll_thread,
        stages,
        commit_loop,
        gauges_stop,
        abandon,
    })
}

/// The adaptive batcher: limits from the configuration, a failed batch-1 verdict retried on a
/// clean arena (a rebuild of the model's sessions), ceilings kept in Kafka when configured.
async fn adaptive(setup: &Setup<'_>, loaded: &Loaded, clients: &Clients) -> Result<Adaptive, StartError> {
    let Setup {
        config, metrics, fatal, ..
    } = *setup;
    let b = &config.batching;
    let limits = BatchSize {
        max_tasks: b.max_batch,
        max_rows: b.max_batch_rows,
    };
    let cleaner = Rebuild {
        serving: loaded.serving.clone(),
        fatal: fatal.clone(),
    };
    let adaptive = Adaptive::new(
        loaded.engine.clone(),
        limits,
        b.probe_after,
        !b.no_serialize_singles,
        metrics.clone(),
    )
    .with_cleaner(Arc::new(cleaner))
    .with_steps_per_call(b.steps_per_call)
    .with_joins(b.step_joins)
    .with_checkpoints(Arc::new(CheckpointStore::new(loaded.images.clone(), metrics.clone())));
    Ok(match clients.ceilings(setup).await? {
        Some(store) => adaptive.with_store(Arc::new(store)),
        None => adaptive,
    })
}

/// Each stage's context, built from what the worker loaded and its clients: outcomes and where
/// they go, storage, the redelivery and crash guards, progress and cancellations.
fn contexts(
    setup: &Setup<'_>,
    loaded: &Loaded,
    clients: &Clients,
    adaptive: Arc<Adaptive>,
    abandon: &CancellationToken,
) -> Result<(DecodeStage, EngineStage), StartError> {
    let Setup { config, worker_id, .. } = *setup;
    let (k, d) = (&config.kafka, &config.delivery);
    let tasks = TaskTracker::new();
    let outcomes = outcomes(setup, clients, abandon, &tasks);
    // A cancel is kept as long as the catalog lets a task wait (its longest deadline).
    let longest_wait = Duration::from_secs(loaded.catalog.longest_ttl_seconds());
    let cancellations = kafka::cancellations(config, worker_id, longest_wait)?;
    let (progress, progress_rx) = ProgressSink::new(worker_id.to_owned(), cancellations.clone());
    tokio::spawn(progress::publish(progress_rx, clients.producer.clone(), k.progress_topic.clone()));
    let offsets = &clients.offsets;
    let crash_guard = Arc::new(CrashGuard::new(offsets.clone(), d.max_crashes));
    let store = Arc::new(retried_store(setup, loaded, abandon));
    let decode = DecodeStage {
        offsets: offsets.clone(),
        redelivery: Arc::new(CommitMetadataLeases::new(offsets.clone(), clients.consumer.clone(), d.lease_span)),
        running: Arc::default(),
        crash_guard: crash_guard.clone(),
        serving: loaded.serving.clone(),
        catalog: loaded.catalog.clone(),
        max_task_bytes: k.max_task_bytes,
        store: store.clone(),
        outcomes: outcomes.clone(),
        tasks: tasks.clone(),
    };
    let finish = FinishStage {
        permits: Semaphore::new(config.storage.storage_concurrency.max(1) * 2),
        store,
        outcomes: outcomes.clone(),
        worker_id: worker_id.to_owned(),
    };
    let engine = EngineStage {
        offsets: offsets.clone(),
        cancellations,
        serving: loaded.serving.clone(),
        adaptive,
        crash_guard,
        progress: Some(progress),
        outcomes,
        tasks,
        finish: Arc::new(finish),
    };
    Ok((decode, engine))
}

/// Where outcomes go: the completion and DLQ topics, straight to the broker or through the
/// transactional outbox (exactly-once), retried until the worker abandons what is in flight.
fn outcomes(setup: &Setup<'_>, clients: &Clients, abandon: &CancellationToken, tasks: &TaskTracker) -> Outcomes {
    let Setup {
        config,
        worker_id,
        metrics,
        ..
    } = *setup;
    let (k, d) = (&config.kafka, &config.delivery);
    let publisher = Publisher::new(
        match d.delivery {
            DeliveryMode::AtLeastOnce => Destination::Broker(clients.producer.clone()),
            DeliveryMode::ExactlyOnce => Destination::Outbox(clients.outbox.clone()),
        },
        k.completions_topic.clone(),
        k.dlq_topic.clone(),
        worker_id.to_owned(),
    );
    Outcomes::new(OutcomeSettings {
        offsets: clients.offsets.clone(),
        publisher: Arc::new(publisher),
        metrics: metrics.clone(),
        worker_id: worker_id.to_owned(),
        group: k.group_id.clone(),
        retry: RetryPolicy::forever(Duration::from_millis(d.retry_base_delay_ms)),
        abandon: abandon.clone(),
        tasks: tasks.clone(),
    })
}

/// The image store with the configured storage retries.
fn retried_store(setup: &Setup<'_>, loaded: &Loaded, abandon: &CancellationToken) -> RetriedStore {
    let d = &setup.config.delivery;
    RetriedStore {
        images: loaded.images.clone(),
        inputs: loaded.inputs.clone(),
        retry: RetryPolicy {
            max_attempts: d.retry_max_attempts,
            max_elapsed: Duration::from_millis(d.retry_max_elapsed_ms),
            base_delay: Duration::from_millis(d.retry_base_delay_ms),
            max_delay: Duration::from_secs(10),
        },
        metrics: setup.metrics.clone(),
        abandon: abandon.clone(),
    }
}
