//! The whole worker as library code, in roles: [`run`] loads the models (`load`), connects to
//! Kafka (`kafka`), serves its HTTP endpoint (`admin`), starts the pipeline (`stages`), serves
//! until `shutdown` (or a fatal reload), then drains (`drain`): within the grace period, commits
//! and leaves the group. [`serve`] is the process around it (its configuration, logs and exit
//! status), which `main` calls; tests call [`run`] in process with their own models
//! ([`Models::Custom`]).

mod admin;
mod drain;
mod identity;
mod kafka;
mod load;
mod stages;

use std::future::Future;
use std::time::Duration;

use clap::Parser;
use sluice_service::shutdown;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::EngineError;
use crate::metrics::Metrics;
use crate::models::Registry;
use crate::models::serving::{ReloadOverrides, Serving, ServingError};
use crate::storage::images::StorageError;

/// Which models the worker runs, and on what.
pub enum Models {
    /// The built-in adapters on ONNX Runtime (`ORT_DYLIB_PATH`, the CPU or CUDA provider).
    Onnx,
    /// These adapters; ONNX Runtime is not loaded (tests: a fake backend).
    Custom(Registry),
}

/// What can keep the worker from starting. Each says what is wrong and where.
#[derive(Debug, Error)]
pub enum StartError {
    #[error(transparent)]
    Runtime(#[from] EngineError),
    #[error("loading models: {0}")]
    Models(#[from] ServingError),
    #[error(transparent)]
    Catalog(#[from] sluice_schemas::CatalogError),
    #[error("{0}")]
    Model(String),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("{what}: {source}")]
    Kafka {
        what: &'static str,
        source: rdkafka::error::KafkaError,
    },
    #[error("binding {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Topics(#[from] sluice_service::kafka::MissingTopics),
    #[error("SLUICE_TEST_FAULTS: {0}")]
    Faults(String),
    #[error("starting the poll thread: {0}")]
    Thread(std::io::Error),
}

/// How the worker stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Shut down on request, after draining.
    Clean,
    /// It could not go on serving (a reload failed for good): the orchestrator should start a
    /// clean process.
    Fatal,
}

impl Exit {
    pub fn code(self) -> i32 {
        match self {
            Exit::Clean => 0,
            Exit::Fatal => 1,
        }
    }
}

/// The `sluice-worker` process: its configuration (flags and `SLUICE_*`), logs and traces, [`run`]
/// until SIGTERM or SIGINT, and its exit status ([`Exit::code`], or 2 when it could not start).
/// Library code, so that `main` is one plain call into this crate: a binary that awaited [`run`]
/// compiled its own copy of much of the worker (the drop glue and tasks of every future under
/// `run`); what that cost is in docs/benchmarks.md, "Cold `make demo`".
#[tokio::main]
pub async fn serve() {
    let config = Config::parse();
    sluice_service::telemetry::init(config.log_format);
    if let Err(e) = sluice_service::otlp::init("sluice-worker") {
        tracing::error!(error = %e, "worker stopped");
        std::process::exit(2);
    }
    let code = match run(config, Models::Onnx, shutdown::terminated()).await {
        Ok(exit) => exit.code(),
        Err(e) => {
            tracing::error!(error = %e, "worker stopped");
            2
        }
    };
    sluice_service::otlp::flush(Duration::from_secs(5)).await;
    // Exit here rather than return: the Kafka clients are being dropped on a thread of their own
    // (their destructors wait on the broker), and everything that had to be acknowledged was.
    std::process::exit(code)
}

/// Runs a worker until `shutdown` resolves (or a reload fails for good). Everything that can be
/// wrong with the setup fails here, with a message, before the worker joins the group.
pub async fn run(mut config: Config, models: Models, shutdown: impl Future<Output = ()>) -> Result<Exit, StartError> {
    // Held for as long as the worker runs: the kernel lets go of it when the process ends.
    let _slot = identity::settle(&mut config);
    let worker_id = config.worker_id();
    let metrics = Metrics::new();
    let fatal = CancellationToken::new();
    let setup = Setup {
        config: &config,
        worker_id: &worker_id,
        metrics: &metrics,
        fatal: &fatal,
    };
    let loaded = load::load(&config, models, &metrics).await?;
    let clients = kafka::Clients::connect(&setup).await?;
    let admin = admin::serve(&setup, &loaded, clients.offsets.clone()).await?;
    tracing::info!(listen = %config.listen, worker_id, models = ?loaded.serving.names(), "worker started");
    let stages = stages::start(&setup, &loaded, &clients).await?;
    loaded.health.send_modify(|h| h.consuming = true);

    let hangups = reload_on_hangup(loaded.serving.clone(), fatal.clone());
    let exit = tokio::select! {
        _ = shutdown => Exit::Clean,
        _ = fatal.cancelled() => Exit::Fatal,
    };
    hangups.abort();

    let grace = match exit {
        Exit::Clean => config.delivery.shutdown_grace(),
        Exit::Fatal => Duration::from_secs(2),
    };
    drain::drain(stages, clients, admin, &loaded.health, grace, exit, &metrics).await;
    Ok(exit)
}

/// What every starting role is given.
struct Setup<'a> {
    config: &'a Config,
    worker_id: &'a str,
    metrics: &'a Metrics,
    /// Fired when the worker cannot go on serving: it drains and exits non-zero.
    fatal: &'a CancellationToken,
}

/// SIGHUP reloads every model; a reload that fails for good stops the worker.
fn reload_on_hangup(serving: std::sync::Arc<Serving>, fatal: CancellationToken) -> tokio::task::JoinHandle<()> {
    let mut hangups = shutdown::hangups();
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading models");
            if let Err(e) = serving.reload(None, ReloadOverrides::default()).await {
                tracing::error!(error = %e, "reload failed; the worker cannot serve and exits");
                fatal.cancel();
            }
        }
    })
}
