//! `sluice-worker`: see the crate documentation.

mod cli;

use clap::Parser;
use sluice_service::telemetry;

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
    sluice_worker::serve();
}

/// The end of a subcommand that logs: on failure its error, logged, and exit status 1.
fn exit_on_error(command: &str, result: anyhow::Result<()>) {
    if let Err(e) = result {
        tracing::error!(error = format!("{e:#}"), "{command} failed");
        std::process::exit(1);
    }
}
