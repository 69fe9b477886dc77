//! `sluice-worker sweep-checkpoints`: see [`sluice_worker::storage::checkpoints::sweep`].

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use sluice_service::telemetry::LogFormat;
use sluice_worker::storage::checkpoints;
use sluice_worker::storage::images::ImageStore;

/// Deletes the step checkpoints in the output store last written more than
/// `--older-than-seconds` ago (a CronJob's job); prints what it did as one JSON line. Endpoint and
/// credentials come from the `AWS_*` variables.
#[derive(Debug, Parser)]
#[command(name = "sluice-worker sweep-checkpoints")]
pub struct SweepArgs {
    /// The workers' output store: `s3://bucket/prefix` (or `file:///path`).
    #[arg(long, env = "SLUICE_OUTPUT_URL")]
    output_url: String,
    /// Age past which a checkpoint is deleted (default 31 days). Keep it above the catalog's
    /// longest `max_ttl_seconds` (30 days unless set): a task that may still carry on wrote its
    /// latest checkpoint within it.
    #[arg(long, env = "SLUICE_CHECKPOINT_SWEEP_AFTER_SECONDS", default_value_t = 2_678_400,
          value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
    older_than_seconds: u64,
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    pub log_format: LogFormat,
}

#[tokio::main]
pub async fn run(args: SweepArgs) -> anyhow::Result<()> {
    let store = ImageStore::from_url(&args.output_url)?;
    let swept = checkpoints::sweep(&store, Duration::from_secs(args.older_than_seconds))
        .await
        .with_context(|| format!("sweeping the checkpoints under {}", args.output_url))?;
    println!("{}", serde_json::to_string(&swept)?);
    Ok(())
}
