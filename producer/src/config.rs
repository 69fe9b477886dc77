//! Producer configuration: every flag is also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use sluice_service::kafka::KafkaClientArgs;
use sluice_service::telemetry::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "sluice-producer",
    version,
    about = "Accepts Sluice tasks over HTTP and publishes them to Kafka; batch submit, replay and redrive"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json, global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API.
    Serve(ServeArgs),
    /// Publish task requests from a JSON-lines file (or stdin), one per line.
    Submit(SubmitArgs),
}

#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub kafka: KafkaClientArgs,
    #[arg(long, env = "SLUICE_TASKS_TOPIC", default_value = sluice_schemas::topics::TASKS)]
    pub tasks_topic: String,
    /// How long a task may wait for the broker's acknowledgement before the request fails with
    /// 503, milliseconds.
    #[arg(long, env = "SLUICE_PUBLISH_TIMEOUT_MS", default_value_t = 5000)]
    pub publish_timeout_ms: u64,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub publish: PublishArgs,
    /// HTTP listen address.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// API keys, `tenant:key` pairs, comma-separated. Requests carry `Authorization: Bearer
    /// <key>` and are published under the key's tenant. Without keys the API is open and every
    /// task belongs to tenant `default` (for local use only).
    #[arg(long, env = "SLUICE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Largest accepted request body, bytes.
    #[arg(long, env = "SLUICE_MAX_BODY_BYTES", default_value_t = 64 * 1024)]
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub publish: PublishArgs,
    /// JSON-lines file of task requests; `-` for stdin.
    #[arg(default_value = "-")]
    pub input: PathBuf,
    /// Tenant the tasks are published under.
    #[arg(long, env = "SLUICE_TENANT", default_value = "default")]
    pub tenant: String,
    /// Tasks awaiting the broker's acknowledgement at once.
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
}
