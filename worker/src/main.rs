//! `sluice-worker`: see the crate documentation.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rdkafka::consumer::Consumer;
use rdkafka::producer::FutureProducer;
use sluice_service::{shutdown, telemetry};
use sluice_worker::adaptive::{Adaptive, BatchSize};
use sluice_worker::batcher::Batcher;
use sluice_worker::config::{Config, DeviceKind};
use sluice_worker::engine::{Device, Engine, Runtime, RuntimeOptions, SessionOptions};
use sluice_worker::http::{self, AppState};
use sluice_worker::lease::Leases;
use sluice_worker::metrics::Metrics;
use sluice_worker::offsets::Offsets;
use sluice_worker::pipeline::{self, Shared};
use sluice_worker::publish::Publisher;
use sluice_worker::retry::RetryPolicy;
use sluice_worker::serving::{Health, ReloadOverrides, Serving};
use sluice_worker::sink::Sink;
use sluice_worker::source::{self, SourceContext, SourceControl, TaskConsumer};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    telemetry::init(config.log_format);
    match run(config).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "worker stopped");
            ExitCode::from(2)
        }
    }
}

/// Waits for a shutdown step at most `limit`.
async fn bounded<F: std::future::Future>(step: &str, limit: Duration, f: F) {
    if tokio::time::timeout(limit, f).await.is_err() {
        tracing::warn!(step, "shutdown step timed out (broker unreachable?); exiting anyway");
    }
}

async fn run(config: Config) -> anyhow::Result<ExitCode> {
    let worker_id = config.worker_id();
    let metrics = Metrics::new();
    let e = &config.engine;

    // Everything that can be wrong with the setup fails here, with a message, before the worker
    // joins the group.
    let runtime = Runtime::init(&RuntimeOptions {
        dylib_path: e.ort_dylib_path.clone(),
        cpu_arena_max_bytes: e.cpu_arena_max_bytes,
    })?;
    let engine = Engine::start(Arc::new(runtime), e.engine_slots);
    let device = match e.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::Cuda {
            device_id: e.cuda_device_id,
            mem_limit: e.gpu_mem_limit,
            arena_extend: e.arena_extend_strategy,
            conv_search: e.cudnn_conv_algo_search,
            require: e.require_gpu,
        },
    };
    let (health_tx, health_rx) = watch::channel(Health::default());
    let serving = Arc::new(
        Serving::start(
            engine.clone(),
            &e.model_dir,
            &e.models,
            SessionOptions {
                device,
                intra_threads: e.intra_threads,
                spin: e.ort_spin,
            },
            metrics.clone(),
            health_tx.clone(),
            e.reload_min_free_bytes,
        )
        .await
        .context("loading models")?,
    );
    let sink = Sink::from_url(&config.storage.output_url)?.with_concurrency(config.storage.storage_concurrency);

    let k = &config.kafka;
    let producer: FutureProducer = k
        .client
        .producer_config(&worker_id, 30_000, 20)
        .create()
        .context("creating the Kafka producer")?;
    let offsets = Arc::new(Offsets::new());
    let d = &config.delivery;
    let leases = Leases::new(sink.clone(), k.group_id.clone(), tokio::runtime::Handle::current());
    let context = SourceContext::new(offsets.clone(), leases, metrics.clone(), d.drain_timeout(), k.tasks_topic.clone());
    let max_poll_interval = (d.drain_timeout().as_millis() as u64 + 20_000).max(30_000).to_string();
    let mut consumer_settings = vec![
        ("group.id", k.group_id.as_str()),
        ("client.id", worker_id.as_str()),
        ("enable.auto.commit", "false"),
        ("enable.auto.offset.store", "false"),
        ("auto.offset.reset", "earliest"),
        ("partition.assignment.strategy", "cooperative-sticky"),
        ("session.timeout.ms", "10000"),
        ("heartbeat.interval.ms", "1000"),
        // The poll thread never waits on inference; the longest it blocks is a revoke's drain
        // plus its commit. This is also how long a rebalance waits for members that are gone,
        // so keep it short: with 300 s a group on the local broker stalled for minutes after a
        // member was killed mid-rebalance.
        ("max.poll.interval.ms", &max_poll_interval),
        // Long-poll fetches: with a 10 ms wait an idle worker and tansu burn most of a core each
        // in fetch round trips; 100 ms costs ~50 ms of pickup latency and nothing at idle.
        ("fetch.wait.max.ms", "100"),
        ("statistics.interval.ms", "5000"),
        // librdkafka prefetches up to 64 MB per partition by default; the worker bounds its own
        // queue (SLUICE_MAX_IN_FLIGHT), so a smaller prefetch bounds memory under floods of
        // large records without slowing steady consumption.
        ("queued.max.messages.kbytes", "16384"),
    ];
    if let Some(instance) = &k.group_instance_id {
        consumer_settings.push(("group.instance.id", instance.as_str()));
    }
    let consumer: Arc<TaskConsumer> = Arc::new(
        k.client
            .config(&consumer_settings)
            .create_with_context(context)
            .context("creating the Kafka consumer")?,
    );
    consumer
        .subscribe(&[k.tasks_topic.as_str()])
        .context("subscribing to the tasks topic")?;

    let fatal = CancellationToken::new();
    let app = Arc::new(AppState {
        metrics: metrics.clone(),
        health: health_rx,
        serving: serving.clone(),
        admin_token: config.admin_token.clone().filter(|t| !t.is_empty()),
        fatal: fatal.clone(),
        offsets: offsets.clone(),
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    tracing::info!(listen = %config.listen, worker_id, models = ?serving.names(), "worker started");
    let server_stop = CancellationToken::new();
    let server = {
        let stop = server_stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, http::router(app))
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        })
    };

    let b = &config.batching;
    let limits = BatchSize {
        max_tasks: b.max_batch,
        max_rows: b.max_batch_rows,
    };
    let adaptive = Arc::new(Adaptive::new(
        engine.clone(),
        limits,
        b.probe_after,
        !b.no_serialize_singles,
        metrics.clone(),
    ));
    let abandon = CancellationToken::new();
    let shared = Arc::new(Shared {
        offsets: offsets.clone(),
        publisher: Publisher::new(producer, k.completions_topic.clone(), k.dlq_topic.clone(), worker_id.clone()),
        sink,
        serving: serving.clone(),
        adaptive: adaptive.clone(),
        metrics: metrics.clone(),
        worker_id: worker_id.clone(),
        max_task_bytes: k.max_task_bytes,
        storage_retry: RetryPolicy {
            max_attempts: d.retry_max_attempts,
            max_elapsed: Duration::from_millis(d.retry_max_elapsed_ms),
            base_delay: Duration::from_millis(d.retry_base_delay_ms),
            max_delay: Duration::from_secs(10),
        },
        publish_retry: RetryPolicy::forever(Duration::from_millis(d.retry_base_delay_ms)),
        abandon: abandon.clone(),
        finishing: Semaphore::new(config.storage.storage_concurrency.max(1) * 2),
        tasks: TaskTracker::new(),
    });

    // The stages.
    let (record_tx, record_rx) = mpsc::channel(d.max_in_flight * 2 + 16);
    let (job_tx, job_rx) = mpsc::channel(d.max_in_flight + 16);
    let (batcher, requests) = Batcher::new(job_rx, adaptive.clone(), Duration::from_millis(b.max_wait_ms));
    let control = SourceControl {
        stop_reading: CancellationToken::new(),
        close: CancellationToken::new(),
    };
    let poll_thread = {
        let (consumer, offsets, control, metrics) = (consumer.clone(), offsets.clone(), control.clone(), metrics.clone());
        let max = d.max_in_flight;
        std::thread::Builder::new()
            .name("sluice-source".into())
            .spawn(move || source::poll_loop(consumer, offsets, record_tx, control, max, metrics))?
    };
    let stages = [
        tokio::spawn(pipeline::decode(record_rx, job_tx, shared.clone())),
        tokio::spawn(batcher.run()),
        tokio::spawn(pipeline::engine(requests, shared.clone(), engine.slots() + 1)),
    ];
    let committer = tokio::spawn(source::commit_loop(
        consumer.clone(),
        offsets.clone(),
        d.commit_interval(),
        metrics.clone(),
        control.close.clone(),
    ));
    let gauges_stop = CancellationToken::new();
    tokio::spawn(pipeline::gauges(shared.clone(), gauges_stop.clone()));
    health_tx.send_modify(|h| h.consuming = true);

    // SIGHUP reloads every model.
    {
        let (serving, fatal) = (serving.clone(), fatal.clone());
        let mut hangups = shutdown::hangups();
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading models");
                if let Err(e) = serving.reload(None, ReloadOverrides::default()).await {
                    tracing::error!(error = %e, "reload failed; the worker cannot serve and exits");
                    fatal.cancel();
                }
            }
        });
    }

    let code = tokio::select! {
        _ = shutdown::terminated() => 0,
        _ = fatal.cancelled() => 1,
    };

    // Drain: stop reading, let every stage finish what it holds, within the grace period.
    health_tx.send_modify(|h| h.shutting_down = true);
    control.stop_reading.cancel();
    let grace = if code == 0 { d.shutdown_grace() } else { Duration::from_secs(2) };
    let drained = tokio::time::timeout(grace, async {
        for stage in stages {
            let _ = stage.await;
        }
        shared.tasks.close();
        shared.tasks.wait().await;
    })
    .await
    .is_ok();
    if !drained {
        tracing::warn!(
            in_flight = offsets.in_flight(),
            "grace period over; abandoning unfinished tasks (they will be read again)"
        );
        abandon.cancel();
        shared.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), shared.tasks.wait()).await;
    }
    // Commit what finished and leave the group. Every step is bounded: with the broker gone a
    // commit can block indefinitely, and the worker must still exit.
    control.close.cancel();
    let final_commit = {
        let (c, o, m) = (consumer.clone(), offsets.clone(), metrics.clone());
        tokio::task::spawn_blocking(move || source::commit_now(&c, &o, &m))
    };
    bounded("final commit", Duration::from_secs(10), final_commit).await;
    bounded("committer", Duration::from_secs(2), committer).await;
    bounded(
        "leaving the group",
        Duration::from_secs(10),
        tokio::task::spawn_blocking(move || poll_thread.join()),
    )
    .await;
    gauges_stop.cancel();
    server_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    tracing::info!(drained, in_flight_left = offsets.in_flight(), exit_code = code, "worker stopped");
    // Exit here rather than unwinding: dropping the Kafka clients runs librdkafka's destructors,
    // which wait on the broker. Everything that had to be acknowledged already was.
    std::process::exit(code)
}
