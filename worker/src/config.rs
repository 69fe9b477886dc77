//! Worker configuration: one clap struct, grouped by concern. Every flag is also an environment
//! variable (12-factor); the S3 endpoint and credentials come from the standard `AWS_*` variables.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use sluice_service::kafka::KafkaClientArgs;
use sluice_service::telemetry::LogFormat;

use crate::batching::fair::TenantWeights;
use crate::engine::{ArenaExtend, ConvSearch};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "sluice-worker",
    version,
    about = "Consumes Sluice tasks from Kafka and runs them on ONNX Runtime"
)]
pub struct Config {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub batching: BatchingArgs,
    #[command(flatten)]
    pub delivery: DeliveryArgs,
    #[command(flatten)]
    pub identity: IdentityArgs,
    /// Address of the HTTP server (`/metrics`, `/healthz`, `/readyz`, `/admin/reload`).
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,
    /// Bearer token required by `/admin/*`; without one they answer 404 (admin is off).
    #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Name of this worker in completion events and logs (default: hostname-pid).
    #[arg(long, env = "SLUICE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Log format: `json` for production, `text` for people.
    #[arg(long, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    pub log_format: LogFormat,
    /// Test-only fault injection (`panic-prepare=SEED`, `panic-run=SEED`, `panic-render=SEED`);
    /// never set in production.
    #[arg(long, env = "SLUICE_TEST_FAULTS", value_delimiter = ',', hide = true)]
    pub test_faults: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    #[command(flatten)]
    pub client: KafkaClientArgs,
    /// Consumer group of the workers.
    #[arg(long, env = "SLUICE_GROUP_ID", default_value = "sluice-workers")]
    pub group_id: String,
    /// Static group membership (`group.instance.id`), e.g. the pod name: a restarted worker gets
    /// its partitions back without a rebalance. Unset: the host slot (`SLUICE_IDENTITY`).
    #[arg(long, env = "SLUICE_GROUP_INSTANCE_ID")]
    pub group_instance_id: Option<String>,
    /// The consumer group protocol: `classic` (cooperative-sticky assignment, static membership)
    /// or `consumer` (KIP-848: the broker assigns, no group-wide rebalance barrier).
    #[arg(long, env = "SLUICE_GROUP_PROTOCOL", value_enum, default_value_t = GroupProtocol::Classic)]
    pub group_protocol: GroupProtocol,
    /// Classic protocol: describe the group every 3 s and, when partitions of the tasks topic
    /// stay owned by no member of the stable group for longer than the drain timeout plus 5 s,
    /// make it rebalance (a short-lived member joins and leaves). `false` only to reproduce the
    /// fault.
    #[arg(long, env = "SLUICE_REPAIR_ORPHANS", default_value_t = true, action = clap::ArgAction::Set)]
    pub repair_orphans: bool,
    #[arg(long, env = "SLUICE_TASKS_TOPIC", default_value = sluice_schemas::topics::TASKS)]
    pub tasks_topic: String,
    /// The interactive lane's own topic, read beside the tasks topic with a window of
    /// `SLUICE_MAX_IN_FLIGHT` of its own. Empty: the lane's tasks are in the tasks topic.
    #[arg(long, env = "SLUICE_INTERACTIVE_TOPIC", default_value = "")]
    pub interactive_topic: String,
    /// The batch lane's own topic (as `SLUICE_INTERACTIVE_TOPIC`).
    #[arg(long, env = "SLUICE_BATCH_TOPIC", default_value = "")]
    pub batch_topic: String,
    #[arg(long, env = "SLUICE_COMPLETIONS_TOPIC", default_value = sluice_schemas::topics::COMPLETIONS)]
    pub completions_topic: String,
    #[arg(long, env = "SLUICE_DLQ_TOPIC", default_value = sluice_schemas::topics::DLQ)]
    pub dlq_topic: String,
    /// Progress records of multi-step models (Stable Diffusion).
    #[arg(long, env = "SLUICE_PROGRESS_TOPIC", default_value = sluice_schemas::topics::PROGRESS)]
    pub progress_topic: String,
    /// Cancels; every worker reads it whole.
    #[arg(long, env = "SLUICE_CONTROL_TOPIC", default_value = sluice_schemas::topics::CONTROL)]
    pub control_topic: String,
    /// Learned batch ceilings, kept across restarts and shared by workers of one device class
    /// (a compacted topic; see docs/batching.md). Empty: kept in memory
    /// only, learned again after every restart.
    #[arg(long, env = "SLUICE_CEILINGS_TOPIC", default_value = sluice_schemas::topics::CEILINGS)]
    pub ceilings_topic: String,
    /// Records larger than this go to the DLQ as `too_large` without being parsed.
    #[arg(long, env = "SLUICE_MAX_TASK_BYTES", default_value_t = 1 << 20)]
    pub max_task_bytes: usize,
}

impl KafkaArgs {
    /// The topics the worker reads tasks from, by lane.
    pub fn task_topics(&self) -> sluice_schemas::topics::TaskTopics {
        sluice_schemas::topics::TaskTopics::new(&self.tasks_topic, &self.interactive_topic, &self.batch_topic)
    }
}

/// Who the worker is when `SLUICE_GROUP_INSTANCE_ID` does not say.
#[derive(Debug, Clone, Args)]
pub struct IdentityArgs {
    /// `host-slot`: the lowest free slot of the worker's group on this host, held by a lock file
    /// (`SLUICE_RUNTIME_DIR/<group>/slot-<n>.lock`), names its group instance id and
    /// transactional id, so a worker restarted by a supervisor gets them back and fences its
    /// previous instance at once; `process`: `<host>-<pid>`, a new group member on every start.
    #[arg(long, env = "SLUICE_IDENTITY", value_enum, default_value_t = IdentityKind::HostSlot)]
    pub identity: IdentityKind,
    /// Where host-slot lock files live (default: `$XDG_RUNTIME_DIR/sluice`, else
    /// `<temporary directory>/sluice-<user>`).
    #[arg(long, env = "SLUICE_RUNTIME_DIR")]
    pub runtime_dir: Option<std::path::PathBuf>,
}

impl IdentityArgs {
    pub fn runtime_dir(&self) -> std::path::PathBuf {
        self.runtime_dir
            .clone()
            .unwrap_or_else(|| match std::env::var_os("XDG_RUNTIME_DIR") {
                Some(run) if !run.is_empty() => std::path::PathBuf::from(run).join("sluice"),
                _ => {
                    let user = std::env::var("USER").unwrap_or_else(|_| "worker".into());
                    std::env::temp_dir().join(format!("sluice-{user}"))
                }
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IdentityKind {
    HostSlot,
    Process,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GroupProtocol {
    Classic,
    Consumer,
}

/// How outcomes reach the completion and DLQ topics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeliveryMode {
    /// Each outcome is published, then its offset committed: a worker killed in between
    /// announces the task again when it is redelivered.
    AtLeastOnce,
    /// Outcomes and the offsets that cover them are committed in one Kafka transaction: a
    /// `read_committed` reader sees each task's outcome once.
    ExactlyOnce,
}

#[derive(Debug, Clone, Args)]
pub struct StorageArgs {
    /// Where images go: `s3://bucket/prefix` or `file:///path`.
    #[arg(long, env = "SLUICE_OUTPUT_URL")]
    pub output_url: String,
    /// Where the producer stores input images (img2img, inpainting): `s3://bucket/prefix` or
    /// `file:///path`, the producer's SLUICE_INPUT_URL. Unset: tasks with input images go to the
    /// DLQ.
    #[arg(long, env = "SLUICE_INPUT_URL")]
    pub input_url: Option<String>,
    /// Storage requests in flight at once (checks, images, manifests), over a pool of kept-alive
    /// connections. Twice as many tasks may be rendered and waiting to store.
    #[arg(long, env = "SLUICE_STORAGE_CONCURRENCY", default_value_t = crate::storage::images::DEFAULT_CONCURRENCY)]
    pub storage_concurrency: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// Where and how ONNX Runtime runs: shared by the worker and `sluice-worker generate`.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Path of libonnxruntime.so.
    #[arg(long, env = "ORT_DYLIB_PATH")]
    pub ort_dylib_path: Option<PathBuf>,
    /// Execution provider.
    #[arg(long, env = "SLUICE_DEVICE", value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// CUDA device id.
    #[arg(long, env = "SLUICE_CUDA_DEVICE_ID", default_value_t = 0)]
    pub cuda_device_id: i32,
    /// `gpu_mem_limit` of the CUDA arena, bytes.
    #[arg(long, env = "SLUICE_GPU_MEM_LIMIT")]
    pub gpu_mem_limit: Option<usize>,
    /// How the CUDA arena grows.
    #[arg(long, env = "SLUICE_ARENA_EXTEND_STRATEGY", value_enum, default_value_t = ArenaExtend::SameAsRequested)]
    pub arena_extend_strategy: ArenaExtend,
    /// cuDNN convolution algorithm search.
    #[arg(long, env = "SLUICE_CUDNN_CONV_ALGO_SEARCH", value_enum, default_value_t = ConvSearch::Heuristic)]
    pub cudnn_conv_algo_search: ConvSearch,
    /// TF32 tensor cores for float32 convolutions and matrix products on CUDA (ONNX Runtime's
    /// `use_tf32`, on by default): faster on Ampere and later, with a 10-bit mantissa inside
    /// those products. `false` computes them in full float32 (see docs on numerics on CUDA).
    #[arg(long, env = "SLUICE_CUDA_TF32", default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_tf32: bool,
    /// Deterministic kernels only (ONNX Runtime's `use_deterministic_compute`): the same inputs
    /// give the same bits on every run, at some cost in speed.
    #[arg(long, env = "SLUICE_CUDA_DETERMINISTIC")]
    pub cuda_deterministic: bool,
    /// Exit instead of falling back to CPU when the CUDA provider can't be registered.
    #[arg(long, env = "SLUICE_REQUIRE_GPU")]
    pub require_gpu: bool,
    /// Cap of a shared CPU arena, bytes. Batches that don't fit fail with a real out-of-memory
    /// error and are halved.
    #[arg(long, env = "SLUICE_ORT_CPU_ARENA_MAX_BYTES")]
    pub cpu_arena_max_bytes: Option<usize>,
    /// Threads inside one operator (0: one per core).
    #[arg(long, env = "SLUICE_INTRA_THREADS", default_value_t = 0)]
    pub intra_threads: usize,
    /// Let ONNX Runtime's threads spin between operators (faster operators, a busy core per
    /// thread while idle; worth it on a dedicated GPU node, not on a shared CPU).
    #[arg(long, env = "SLUICE_ORT_SPIN")]
    pub ort_spin: bool,
}

impl DeviceArgs {
    pub fn runtime_options(&self) -> crate::engine::RuntimeOptions {
        crate::engine::RuntimeOptions {
            dylib_path: self.ort_dylib_path.clone(),
            cpu_arena_max_bytes: self.cpu_arena_max_bytes,
        }
    }

    pub fn session_options(&self) -> crate::engine::SessionOptions {
        let device = match self.device {
            DeviceKind::Cpu => crate::engine::Device::Cpu,
            DeviceKind::Cuda => crate::engine::Device::Cuda {
                device_id: self.cuda_device_id,
                mem_limit: self.gpu_mem_limit,
                arena_extend: self.arena_extend_strategy,
                conv_search: self.cudnn_conv_algo_search,
                tf32: self.cuda_tf32,
                deterministic: self.cuda_deterministic,
                require: self.require_gpu,
            },
        };
        crate::engine::SessionOptions {
            device,
            intra_threads: self.intra_threads,
            spin: self.ort_spin,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Model repository: the catalog's relative paths start here (by default one directory per
    /// model name).
    #[arg(long, env = "SLUICE_MODEL_DIR")]
    pub model_dir: PathBuf,
    /// The model catalog (TOML): each model's name, kind, path and bounds. Without it, the
    /// built-in terrain model alone (at `<model dir>/terrain/model.onnx`).
    #[arg(long, env = "SLUICE_MODEL_CATALOG")]
    pub model_catalog: Option<PathBuf>,
    /// Models of the catalog to serve, comma-separated; all of them when empty.
    #[arg(long, env = "SLUICE_MODELS", value_delimiter = ',')]
    pub models: Vec<String>,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Batches that may run on the device at once, each on its own engine thread and session.
    #[arg(long, env = "SLUICE_ENGINE_SLOTS", default_value_t = 1)]
    pub engine_slots: usize,
    /// Engine slots kept for the interactive lane, beside `SLUICE_ENGINE_SLOTS`: an interactive
    /// call runs on one first, so it does not wait for the shared slots' calls (it still waits
    /// when every kept slot is busy, or for an exclusive call in its turn).
    /// Each holds its own session of every model (that much more memory); for a GPU, whose
    /// streams run one small call beside a large one.
    #[arg(long, env = "SLUICE_INTERACTIVE_SLOTS", default_value_t = 0)]
    pub interactive_slots: usize,
    /// Free memory a reload requires before it loads the new model, bytes (CPU: available system
    /// memory; CUDA: free device memory). Below it the worker exits for a clean restart.
    #[arg(long, env = "SLUICE_RELOAD_MIN_FREE_BYTES", default_value_t = 256 << 20)]
    pub reload_min_free_bytes: u64,
    /// How much more memory may be in use right after a model is unloaded than after its first
    /// unload, bytes (CUDA: the device memory this process holds, from NVML's process list, or
    /// the whole device's in use where NVML does not list the process; CPU: the process's RSS).
    /// Above it a reload leaks, and the worker exits non-zero.
    #[arg(long, env = "SLUICE_RELOAD_LEAK_BOUND_BYTES", default_value_t = 512 << 20)]
    pub reload_leak_bound_bytes: u64,
}

#[derive(Debug, Clone, Args)]
pub struct BatchingArgs {
    /// Most tasks in one model call.
    #[arg(long, env = "SLUICE_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,
    /// Most rows (entries on the model's batch axis: tiles, images) in one model call; a bucket's
    /// batch is capped at this many rows' worth of tasks, and never below one task.
    #[arg(long, env = "SLUICE_MAX_BATCH_ROWS", default_value_t = 64)]
    pub max_batch_rows: usize,
    /// Longest a task waits for its batch to fill, milliseconds (an interactive task does not
    /// wait).
    #[arg(long, env = "SLUICE_MAX_WAIT_MS", default_value_t = 50)]
    pub max_wait_ms: u64,
    /// Clean batches at the learned ceiling before trying one task more.
    #[arg(long, env = "SLUICE_PROBE_AFTER", default_value_t = 16)]
    pub probe_after: u32,
    /// Tenants' shares of the device within a priority lane, `tenant=weight,…` (1 to 1000; a
    /// tenant not listed weighs 1): backlogged tenants get rows in proportion to their weights.
    #[arg(long, env = "SLUICE_TENANT_WEIGHTS", value_parser = TenantWeights::from_arg, default_value = "")]
    pub tenant_weights: TenantWeights,
    /// The most denoising steps one model call runs (0: all of a batch's steps in one call). A
    /// diffusion batch runs as calls of this many steps, its rows' state carried from one to the
    /// next, and each call takes its own turn at the device: a task of another bucket or lane
    /// waits for this many steps of a long batch, not for all of them, and tasks of the bucket
    /// join and leave the running batch between calls. An interactive batch runs all its steps
    /// in one call.
    #[arg(long, env = "SLUICE_STEPS_PER_CALL", default_value_t = 1)]
    pub steps_per_call: usize,
    /// Whether tasks join a running diffusion batch of their bucket between its calls
    /// (continuous batching). Off, a batch's rows start together and it still takes its turn at
    /// the device call by call: a bucket whose model runs rows at different steps as separate
    /// model calls (an ordinary UNet export takes one timestep a call) keeps its rows in step.
    #[arg(long, env = "SLUICE_STEP_JOINS", default_value_t = true, action = clap::ArgAction::Set)]
    pub step_joins: bool,
    /// Turns off the exclusive device permit at batch 1 (for experiments only).
    #[arg(long, env = "SLUICE_NO_SERIALIZE_SINGLES", hide = true)]
    pub no_serialize_singles: bool,
}

#[derive(Debug, Clone, Args)]
pub struct DeliveryArgs {
    /// `exactly-once` or `at-least-once` (see docs/delivery.md).
    #[arg(long, env = "SLUICE_DELIVERY", value_enum, default_value_t = DeliveryMode::ExactlyOnce)]
    pub delivery: DeliveryMode,
    /// The transactional id of exactly-once delivery: stable per worker identity, so that a
    /// restarted worker fences its previous instance and aborts its open transaction (default:
    /// `<group>.<group instance id or worker id>`). The worker's two transactional producers,
    /// which take turns, use it and it with `.2` appended.
    #[arg(long, env = "SLUICE_TRANSACTIONAL_ID")]
    pub transactional_id: Option<String>,
    /// Tasks read but not yet finished before the worker pauses its partitions (it resumes at
    /// half). Unstarted tasks cost only their record, and a revoke hands them on untouched; the
    /// limit should cover a couple of seconds of throughput, because fetching takes up to a
    /// second to restart after a resume (measured on the local broker: 256 capped a ~1 ms model
    /// at 255 tasks/s, 2048 let it reach 590 tasks/s, the machine's CPU limit).
    #[arg(long, env = "SLUICE_MAX_IN_FLIGHT", default_value_t = 2048)]
    pub max_in_flight: usize,
    /// A record started this many times without an outcome (each start ended the worker running
    /// it: an abort, a segfault in native code, an OOM kill) goes to the DLQ as `crashed`
    /// instead of running again; a record started before runs in a model call of its own. Every
    /// model call records its records' starts in the commit metadata; it waits for that commit
    /// only for records an earlier owner may have started (below its lease), the others' starts
    /// ride with the next commit, so the first start of a record new to the group can go
    /// uncounted (at most one start more than this). 0 turns the guard off.
    #[arg(long, env = "SLUICE_MAX_CRASHES", default_value_t = 3)]
    pub max_crashes: u32,
    /// How often finished offsets are committed, milliseconds.
    #[arg(long, env = "SLUICE_COMMIT_INTERVAL_MS", default_value_t = 500)]
    pub commit_interval_ms: u64,
    /// Exactly-once: the least time between the starts of two transactions, milliseconds. A
    /// task that finishes after a quiet spell, or of the interactive lane, is announced by a
    /// transaction begun at once; under load, each transaction carries what finished in this long
    /// rather than the two or three tasks of one round trip (0: back to back). See
    /// docs/delivery.md.
    #[arg(long, env = "SLUICE_TRANSACTION_INTERVAL_MS", default_value_t = 30)]
    pub transaction_interval_ms: u64,
    /// On a revoke, how long in-flight tasks of the revoked partitions may take to finish.
    #[arg(long, env = "SLUICE_DRAIN_TIMEOUT_MS", default_value_t = 10_000)]
    pub drain_timeout_ms: u64,
    /// On SIGTERM, how long the worker drains before it commits and leaves. Keep it below the
    /// orchestrator's grace period (Kubernetes: terminationGracePeriodSeconds).
    #[arg(long, env = "SLUICE_SHUTDOWN_GRACE_MS", default_value_t = 20_000)]
    pub shutdown_grace_ms: u64,
    /// Attempts of a transient failure (storage, broker) before the task is dead-lettered.
    #[arg(long, env = "SLUICE_RETRY_MAX_ATTEMPTS", default_value_t = 20)]
    pub retry_max_attempts: u32,
    /// Total time a task may spend retrying transient failures, milliseconds.
    #[arg(long, env = "SLUICE_RETRY_MAX_ELAPSED_MS", default_value_t = 300_000)]
    pub retry_max_elapsed_ms: u64,
    /// First retry delay, milliseconds; it doubles each attempt, with jitter, up to 10 s.
    #[arg(long, env = "SLUICE_RETRY_BASE_DELAY_MS", default_value_t = 200)]
    pub retry_base_delay_ms: u64,
    /// Records a partition's read lease covers beyond the record that extended it (one lease
    /// commit per this many records; see docs/delivery.md). Tests lower it to
    /// exercise lease commits.
    #[arg(long, env = "SLUICE_LEASE_SPAN", default_value_t = crate::source::redelivery::LEASE_SPAN, hide = true)]
    pub lease_span: i64,
}

impl DeliveryArgs {
    pub fn commit_interval(&self) -> Duration {
        Duration::from_millis(self.commit_interval_ms)
    }
    pub fn transaction_interval(&self) -> Duration {
        Duration::from_millis(self.transaction_interval_ms)
    }
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
}

impl Config {
    /// The transactional id of exactly-once delivery.
    pub fn transactional_id(&self) -> String {
        self.delivery.transactional_id.clone().unwrap_or_else(|| {
            let identity = self.kafka.group_instance_id.clone().unwrap_or_else(|| self.worker_id());
            format!("{}.{identity}", self.kafka.group_id)
        })
    }

    pub fn worker_id(&self) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(|| format!("{}-{}", host_name(), std::process::id()))
    }
}

/// This host's name (`worker` where it cannot be read): the first part of a worker's default
/// names.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "worker".into(), |h| h.trim().to_owned())
}
