//! Producer configuration: every flag is also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use sluice_schemas::topics::TaskTopics;
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
    Serve(Box<ServeArgs>),
    /// Publish task requests from a JSON-lines file (or stdin), one per line.
    Submit(SubmitArgs),
    /// Copy a range of a topic of task records (the tasks topic by default) onto the tasks
    /// topic again, optionally only some models or tenants. Finished tasks are re-announced,
    /// not run again.
    Replay(ReplayArgs),
    /// Copy the original records of DLQ records back onto the tasks topic, optionally only some
    /// reasons. Each task at most once per run.
    Redrive(RedriveArgs),
}

/// The range of a topic a replay or redrive reads. Without bounds: every partition, from the
/// beginning to the end as it was when the run started.
#[derive(Debug, Clone, Args)]
pub struct RangeArgs {
    /// Only these partitions (comma-separated).
    #[arg(long, env = "SLUICE_RANGE_PARTITIONS", value_delimiter = ',')]
    pub partition: Vec<i32>,
    /// Start offsets, `partition=offset` (inclusive), comma-separated.
    #[arg(long, env = "SLUICE_RANGE_FROM_OFFSETS", value_delimiter = ',', value_parser = parse_partition_offset)]
    pub from_offset: Vec<(i32, i64)>,
    /// End offsets, `partition=offset` (exclusive), comma-separated.
    #[arg(long, env = "SLUICE_RANGE_TO_OFFSETS", value_delimiter = ',', value_parser = parse_partition_offset)]
    pub to_offset: Vec<(i32, i64)>,
    /// Records at or after this time (RFC 3339), found through the broker's timestamp lookup.
    #[arg(long, env = "SLUICE_RANGE_SINCE")]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Records before this time (RFC 3339).
    #[arg(long, env = "SLUICE_RANGE_UNTIL")]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Count what would be written, write nothing.
    #[arg(long, env = "SLUICE_DRY_RUN")]
    pub dry_run: bool,
    /// No progress bar (it is drawn on stderr when that is a terminal).
    #[arg(long, env = "SLUICE_NO_PROGRESS")]
    pub no_progress: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub publish: PublishArgs,
    #[command(flatten)]
    pub range: RangeArgs,
    /// Topic to read (default: the tasks topic itself).
    #[arg(long, env = "SLUICE_REPLAY_SOURCE_TOPIC")]
    pub source_topic: Option<String>,
    /// Only tasks of these models (comma-separated).
    #[arg(long, env = "SLUICE_REPLAY_MODELS", value_delimiter = ',')]
    pub model: Vec<String>,
    /// Only tasks of these tenants (comma-separated).
    #[arg(long, env = "SLUICE_REPLAY_TENANTS", value_delimiter = ',')]
    pub tenant: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct RedriveArgs {
    #[command(flatten)]
    pub publish: PublishArgs,
    #[command(flatten)]
    pub range: RangeArgs,
    #[arg(long, env = "SLUICE_DLQ_TOPIC", default_value = sluice_schemas::topics::DLQ)]
    pub dlq_topic: String,
    /// Only DLQ records with these reasons (comma-separated: malformed, schema_violation,
    /// unsupported_version, unsupported_model, too_large, resource_exhausted, model_error,
    /// storage_rejected, retries_exhausted, crashed, idempotency_conflict).
    #[arg(long, env = "SLUICE_REDRIVE_REASONS", value_delimiter = ',', value_parser = parse_reason)]
    pub reason: Vec<sluice_schemas::DlqReason>,
}

fn parse_partition_offset(s: &str) -> Result<(i32, i64), String> {
    let (p, o) = s.split_once('=').ok_or_else(|| format!("expected partition=offset, got {s:?}"))?;
    Ok((
        p.trim().parse().map_err(|_| format!("bad partition in {s:?}"))?,
        o.trim().parse().map_err(|_| format!("bad offset in {s:?}"))?,
    ))
}

fn parse_reason(s: &str) -> Result<sluice_schemas::DlqReason, String> {
    sluice_schemas::DlqReason::parse(s.trim()).ok_or_else(|| {
        let known: Vec<&str> = sluice_schemas::DlqReason::ALL.iter().map(|r| r.as_str()).collect();
        format!("unknown reason {s:?}; one of {}", known.join(", "))
    })
}

#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub kafka: KafkaClientArgs,
    #[arg(long, env = "SLUICE_TASKS_TOPIC", default_value = sluice_schemas::topics::TASKS)]
    pub tasks_topic: String,
    /// The interactive lane's own topic (the workers read it with a window of their own, so a
    /// backlog of other work is never in front of it). Empty: the lane's tasks go to the tasks
    /// topic.
    #[arg(long, env = "SLUICE_INTERACTIVE_TOPIC", default_value = "")]
    pub interactive_topic: String,
    /// The batch lane's own topic (as `SLUICE_INTERACTIVE_TOPIC`).
    #[arg(long, env = "SLUICE_BATCH_TOPIC", default_value = "")]
    pub batch_topic: String,
    /// How long a task may wait for the broker's acknowledgement before the request fails with
    /// 503, milliseconds.
    #[arg(long, env = "SLUICE_PUBLISH_TIMEOUT_MS", default_value_t = 5000)]
    pub publish_timeout_ms: u64,
    /// The model catalog (TOML): the served models, their bounds and defaults. Without it, the
    /// built-in terrain model alone.
    #[arg(long, env = "SLUICE_MODEL_CATALOG")]
    pub model_catalog: Option<std::path::PathBuf>,
}

impl PublishArgs {
    /// The topic of each lane's tasks.
    pub fn task_topics(&self) -> TaskTopics {
        TaskTopics::new(&self.tasks_topic, &self.interactive_topic, &self.batch_topic)
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub publish: PublishArgs,
    /// HTTP listen address.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address of the metrics listener (`GET /metrics`, Prometheus text), apart from the API:
    /// a scraper needs no API key and callers of the API cannot read it.
    #[arg(long, env = "SLUICE_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    /// API keys, `tenant:key` pairs, comma-separated. Requests carry `Authorization: Bearer
    /// <key>` and are published under the key's tenant. Required unless
    /// `SLUICE_ALLOW_ANONYMOUS=true`.
    #[arg(long, env = "SLUICE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Priority lanes per tenant, `tenant=lane+lane` entries, comma-separated (lanes:
    /// interactive, standard, batch). A tenant not listed may ask for standard and batch.
    #[arg(long, env = "SLUICE_TENANT_LANES", value_delimiter = ',')]
    pub tenant_lanes: Vec<String>,
    /// Serve without API keys: every caller is tenant `default` and sees every task (local use
    /// only). Without keys and without this, the producer refuses to start.
    #[arg(long, env = "SLUICE_ALLOW_ANONYMOUS", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_anonymous: bool,
    /// Largest accepted request body, bytes. With SLUICE_INPUT_URL set, a body may be larger by
    /// two data URLs of SLUICE_MAX_INPUT_IMAGE_BYTES.
    #[arg(long, env = "SLUICE_MAX_BODY_BYTES", default_value_t = 64 * 1024)]
    pub max_body_bytes: usize,
    /// Bytes of submission bodies read and admitted at once (each counts its Content-Length, or
    /// the whole limit without one); past it a submission is a 503 with Retry-After. At least
    /// one body of the largest size.
    #[arg(long, env = "SLUICE_BODY_BYTES_IN_FLIGHT", default_value_t = 64 << 20)]
    pub body_bytes_in_flight: usize,
    /// Where input images of img2img and inpainting requests are stored (`s3://bucket/prefix`
    /// or `file:///path`; the workers' SLUICE_INPUT_URL). Unset: requests with images are
    /// refused.
    #[arg(long, env = "SLUICE_INPUT_URL")]
    pub input_url: Option<String>,
    /// The largest input image, bytes, decoded from its data URL.
    #[arg(long, env = "SLUICE_MAX_INPUT_IMAGE_BYTES", default_value_t = crate::input_images::DEFAULT_MAX_BYTES)]
    pub max_input_image_bytes: usize,
    /// The status view's file on local disk (rebuilt from the topics on start).
    #[arg(long, env = "SLUICE_STATUS_PATH", default_value = "sluice-status/view.redb")]
    pub status_path: PathBuf,
    /// How long the status view keeps a task after its last change, hours.
    #[arg(long, env = "SLUICE_STATUS_RETENTION_HOURS", default_value_t = 168)]
    pub status_retention_hours: u64,
    #[arg(long, env = "SLUICE_COMPLETIONS_TOPIC", default_value = sluice_schemas::topics::COMPLETIONS)]
    pub completions_topic: String,
    #[arg(long, env = "SLUICE_PROGRESS_TOPIC", default_value = sluice_schemas::topics::PROGRESS)]
    pub progress_topic: String,
    /// How long the presigned URLs of a task's images stay valid, seconds.
    #[arg(long, env = "SLUICE_PRESIGN_TTL_SECONDS", default_value_t = 3600)]
    pub presign_ttl_seconds: u64,
    /// Where cancels go; every worker reads it whole.
    #[arg(long, env = "SLUICE_CONTROL_TOPIC", default_value = sluice_schemas::topics::CONTROL)]
    pub control_topic: String,
    /// The longest a `GET /v1/tasks/{id}/events` stream stays open, seconds; the client then
    /// reconnects with `Last-Event-ID` (as SSE clients do). Fractions allowed.
    #[arg(long, env = "SLUICE_EVENTS_MAX_SECONDS", default_value_t = 300.0)]
    pub events_max_seconds: f64,
    /// Event streams open at once on this replica; past it a new one is refused (429 with
    /// `Retry-After`).
    #[arg(long, env = "SLUICE_EVENTS_MAX_STREAMS", default_value_t = 10_000)]
    pub events_max_streams: usize,
    /// Event streams one tenant may hold open at once on this replica (429 past it).
    #[arg(long, env = "SLUICE_EVENTS_MAX_STREAMS_PER_TENANT", default_value_t = 100)]
    pub events_max_streams_per_tenant: usize,
    /// The workers' consumer group, whose backlog on the tasks topic this replica measures
    /// (`sluice_producer_backlog_*`: tasks not committed and the oldest one's age, workers up or
    /// not). It only reads the group's offsets.
    #[arg(long, env = "SLUICE_WORKER_GROUP", default_value = "sluice-workers")]
    pub worker_group: String,
    /// How often the backlog is measured, milliseconds (0: not at all).
    #[arg(long, env = "SLUICE_BACKLOG_INTERVAL_MS", default_value_t = 10_000)]
    pub backlog_interval_ms: u64,
    #[command(flatten)]
    pub webhooks: WebhookArgs,
}

/// Webhook delivery (the notifier runs inside `serve`).
#[derive(Debug, Clone, Args)]
pub struct WebhookArgs {
    /// Deliver webhooks from this replica (a member of the notifier group). Off: tasks with a
    /// webhook are still accepted when secrets are configured, and other replicas deliver.
    #[arg(long = "webhooks", env = "SLUICE_WEBHOOKS", default_value_t = true, action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// Signing secrets, `tenant:whsec_<base64>` pairs, comma-separated; several per tenant sign
    /// with each (rotation). A tenant without one cannot ask for webhooks.
    #[arg(
        long = "webhook-secrets",
        env = "SLUICE_WEBHOOK_SECRETS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub secrets: Vec<String>,
    /// A file of such pairs, one per line (`#` comments), e.g. a mounted Secret.
    #[arg(long = "webhook-secrets-file", env = "SLUICE_WEBHOOK_SECRETS_FILE")]
    pub secrets_file: Option<PathBuf>,
    /// CIDRs webhooks may reach although they are internal (loopback, private, …), over plain
    /// http too, e.g. `127.0.0.0/8` for tests or `10.0.0.0/8` for a private deployment.
    #[arg(long = "webhook-allow-cidrs", env = "SLUICE_WEBHOOK_ALLOW_CIDRS", value_delimiter = ',')]
    pub allow_cidrs: Vec<String>,
    /// Allow plain http to public addresses (https is required otherwise).
    #[arg(long = "webhook-allow-http", env = "SLUICE_WEBHOOK_ALLOW_HTTP")]
    pub allow_http: bool,
    /// Waits before each retry of a `completed` event (`5s,5m,30m,2h,5h,10h,10h`: eight
    /// attempts over 32.6 h). Each distinct delay uses one partition of the retry topic.
    #[arg(long = "webhook-retry-schedule", env = "SLUICE_WEBHOOK_RETRY_SCHEDULE", default_value = crate::webhook::schedule::RetrySchedule::DEFAULT)]
    pub retry_schedule: String,
    /// Time limit of one attempt, milliseconds.
    #[arg(long = "webhook-timeout-ms", env = "SLUICE_WEBHOOK_TIMEOUT_MS", default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Attempts in flight at once.
    #[arg(long = "webhook-concurrency", env = "SLUICE_WEBHOOK_CONCURRENCY", default_value_t = 64)]
    pub concurrency: usize,
    /// Attempts in flight at once to one receiver host.
    #[arg(long = "webhook-host-concurrency", env = "SLUICE_WEBHOOK_HOST_CONCURRENCY", default_value_t = 8)]
    pub host_concurrency: usize,
    /// Consumed records not yet finished (waiting retries included) before the notifier stops
    /// fetching.
    #[arg(long = "webhook-max-pending", env = "SLUICE_WEBHOOK_MAX_PENDING", default_value_t = 10_000)]
    pub max_pending: usize,
    /// Consumer group of the notifiers.
    #[arg(long = "webhook-group", env = "SLUICE_WEBHOOK_GROUP", default_value = "sluice-webhooks")]
    pub group: String,
    /// Static group membership of this replica's notifier (e.g. the pod name).
    #[arg(long = "webhook-group-instance-id", env = "SLUICE_WEBHOOK_GROUP_INSTANCE_ID")]
    pub group_instance_id: Option<String>,
    #[arg(long = "webhook-retry-topic", env = "SLUICE_WEBHOOK_RETRY_TOPIC", default_value = sluice_schemas::topics::WEBHOOK_RETRY)]
    pub retry_topic: String,
    #[arg(long = "webhook-dlq-topic", env = "SLUICE_WEBHOOK_DLQ_TOPIC", default_value = sluice_schemas::topics::WEBHOOK_DLQ)]
    pub dlq_topic: String,
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
