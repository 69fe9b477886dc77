//! `sluice-worker sync-models`: see [`sluice_worker::storage::sync_models`].

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use sluice_service::telemetry::LogFormat;
use sluice_worker::storage::images::ImageStore;
use sluice_worker::storage::sync_models;

/// Copies a model repository from object storage to a local directory (an initContainer's job);
/// prints what it did as one JSON line. Endpoint and credentials come from the `AWS_*` variables.
#[derive(Debug, Parser)]
#[command(name = "sluice-worker sync-models")]
pub struct SyncArgs {
    /// Where the models are: `s3://bucket/prefix` (or `file:///path`).
    #[arg(long, env = "SLUICE_MODELS_URL")]
    from: String,
    /// The local model directory (the worker's `SLUICE_MODEL_DIR`).
    #[arg(long, env = "SLUICE_MODEL_DIR")]
    to: PathBuf,
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    pub log_format: LogFormat,
}

#[tokio::main]
pub async fn run(args: SyncArgs) -> anyhow::Result<()> {
    let source = ImageStore::from_url(&args.from)?;
    let summary = sync_models::sync(&source, &args.to)
        .await
        .with_context(|| format!("copying {} to {}", args.from, args.to.display()))?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}
