//! `sluice-worker`: see the crate documentation.

mod cli;

use clap::Parser;
use sluice_service::{shutdown, telemetry};
use sluice_worker::config::Config;
use sluice_worker::{Models, run};

fn main() {
    // `sluice-worker generate ...`: one run from the command line; anything else is the worker.
    if std::env::args().nth(1).as_deref() == Some("generate") {
        let args = cli::generate::GenerateArgs::parse_from(std::env::args().skip(1));
        telemetry::init(sluice_service::telemetry::LogFormat::Text);
        if let Err(e) = cli::generate::run(args) {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    // `sluice-worker sync-models ...`: copy the model repository from object storage, then exit.
    if std::env::args().nth(1).as_deref() == Some("sync-models") {
        let args = cli::sync_models::SyncArgs::parse_from(std::env::args().skip(1));
        telemetry::init(args.log_format);
        return exit_on_error("sync-models", cli::sync_models::run(args));
    }
    // `sluice-worker sweep-checkpoints ...`: delete step checkpoints past an age, then exit.
    if std::env::args().nth(1).as_deref() == Some("sweep-checkpoints") {
        let args = cli::sweep_checkpoints::SweepArgs::parse_from(std::env::args().skip(1));
        telemetry::init(args.log_format);
        return exit_on_error("sweep-checkpoints", cli::sweep_checkpoints::run(args));
    }
    serve();
}

/// The end of a subcommand that logs: on failure its error, logged, and exit status 1.
fn exit_on_error(command: &str, result: anyhow::Result<()>) {
    if let Err(e) = result {
        tracing::error!(error = format!("{e:#}"), "{command} failed");
        std::process::exit(1);
    }
}

#[tokio::main]
async fn serve() {
    let config = Config::parse();
    telemetry::init(config.log_format);
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
    sluice_service::otlp::flush(std::time::Duration::from_secs(5)).await;
    // Exit here rather than return: the Kafka clients are being dropped on a thread of their own
    // (their destructors wait on the broker), and everything that had to be acknowledged was.
    std::process::exit(code)
}
