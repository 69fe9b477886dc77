//! Rust types of the records described by `schemas/v1/*.schema.json`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

/// Body of `POST /v1/tasks` (`task-request.schema.json`). Absent values take the model's defaults
/// when the producer turns it into a [`TaskRecord`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRequest {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_images: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Map<String, Value>>,
    /// Run by then or not at all (RFC 3339); exclusive with `ttl_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    /// Run within this many seconds of submission or not at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// The task's lane (`interactive`, `standard`, `batch`); `standard` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<crate::Priority>,
    /// Where the task's events are pushed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookSpec>,
    /// img2img (with `mask_image`: inpainting): the image to start from, as a data URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_image: Option<String>,
    /// Inpainting: the mask (white repaints), as a data URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_image: Option<String>,
    /// img2img and inpainting: the share of the schedule that runs, (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<f64>,
}

/// An input image the producer stored under its content address (`generation.schema.json`'s
/// `image_ref`): `key` is `<sha256>.png` in the deployment's input store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRef {
    pub key: String,
    /// SHA-256 (hex) of the stored bytes.
    pub sha256: String,
}

impl ImageRef {
    /// The reference of stored bytes whose SHA-256 is `sha256` (hex).
    pub fn of_sha256(sha256: String) -> ImageRef {
        ImageRef {
            key: format!("{sha256}.png"),
            sha256,
        }
    }

    /// Whether the key is the content address of the hash (the schema checks both shapes).
    pub fn is_content_addressed(&self) -> bool {
        self.key.strip_suffix(".png") == Some(self.sha256.as_str())
    }
}

/// Fully explicit generation parameters, as carried by a [`TaskRecord`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    pub prompt: String,
    /// Absent is not empty (SDXL's `force_zeros_for_empty_prompt`): kept as the client sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    pub steps: u32,
    pub guidance_scale: f64,
    pub seed: u64,
    pub sampler: String,
    pub width: u32,
    pub height: u32,
    pub num_images: u32,
    pub params: Map<String, Value>,
    /// img2img and inpainting: the stored image to start from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_image: Option<ImageRef>,
    /// Inpainting: the stored mask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_image: Option<ImageRef>,
    /// With `init_image`: the share of the schedule that runs, (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<f64>,
}

/// A record on the tasks topic (`task.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRecord {
    pub version: u32,
    pub task_id: Uuid,
    pub submitted_at: DateTime<Utc>,
    pub tenant: String,
    #[serde(default)]
    pub user: Option<String>,
    pub model: String,
    pub request: Generation,
    /// The client's `Idempotency-Key`, when it sent one: the task id is derived from the tenant
    /// and the key, and the request's hash tells a retry from a conflicting reuse of the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<Idempotency>,
    /// A worker that dequeues the task after this does not run it: its completion says
    /// `expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
    /// The task's lane; left out when `standard`, so that a worker of an earlier release still
    /// reads every standard task.
    #[serde(default, skip_serializing_if = "crate::Priority::is_standard")]
    pub priority: crate::Priority,
    /// Where the task's events are pushed (`webhook.schema.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookSpec>,
}

/// How a task was made idempotent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Idempotency {
    pub key: String,
    /// SHA-256 (hex) of the request body as the producer parsed it (keys sorted, no spaces).
    pub request_sha256: String,
}

/// Where a record was read from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceRef {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompletionStatus {
    Succeeded,
    Failed,
    /// Cancelled by its client before it finished: never run, or stopped between steps. No
    /// images are stored and nothing goes to the DLQ.
    Cancelled,
    /// Dequeued after its deadline: not run, no images, no DLQ record.
    Expired,
}

impl CompletionStatus {
    pub const ALL: [CompletionStatus; 4] = [
        CompletionStatus::Succeeded,
        CompletionStatus::Failed,
        CompletionStatus::Cancelled,
        CompletionStatus::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CompletionStatus::Succeeded => "succeeded",
            CompletionStatus::Failed => "failed",
            CompletionStatus::Cancelled => "cancelled",
            CompletionStatus::Expired => "expired",
        }
    }
}

/// One stored image of a completed task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputRef {
    pub index: u32,
    pub url: String,
    pub key: String,
    pub content_type: String,
    pub bytes: u64,
    pub sha256: String,
    pub width: u32,
    pub height: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionError {
    pub reason: DlqReason,
    pub message: String,
}

/// Milliseconds spent in each phase of a task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timings {
    pub queued_ms: u64,
    pub inference_ms: u64,
    pub upload_ms: u64,
    pub total_ms: u64,
}

/// A record on the completions topic (`completion.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionEvent {
    pub version: u32,
    pub task_id: Uuid,
    pub status: CompletionStatus,
    pub model: String,
    pub tenant: String,
    #[serde(default)]
    pub user: Option<String>,
    pub outputs: Vec<OutputRef>,
    #[serde(default)]
    pub error: Option<CompletionError>,
    pub timings: Timings,
    pub worker_id: String,
    pub attempt: u32,
    pub completed_at: DateTime<Utc>,
    pub source: SourceRef,
}

/// Why a record was dead-lettered (`dlq.schema.json#/$defs/reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqReason {
    Malformed,
    SchemaViolation,
    UnsupportedVersion,
    UnsupportedModel,
    TooLarge,
    ResourceExhausted,
    ModelError,
    StorageRejected,
    RetriesExhausted,
    /// Started `SLUICE_MAX_CRASHES` times without an outcome: each start ended the worker
    /// running it (an abort, a segfault in native code, an OOM kill).
    Crashed,
    /// The task's id (from its tenant and `Idempotency-Key`) already has results, made for a
    /// request with another hash: the key was reused for another request.
    IdempotencyConflict,
}

impl DlqReason {
    pub const ALL: [DlqReason; 11] = [
        DlqReason::Malformed,
        DlqReason::SchemaViolation,
        DlqReason::UnsupportedVersion,
        DlqReason::UnsupportedModel,
        DlqReason::TooLarge,
        DlqReason::ResourceExhausted,
        DlqReason::ModelError,
        DlqReason::StorageRejected,
        DlqReason::RetriesExhausted,
        DlqReason::Crashed,
        DlqReason::IdempotencyConflict,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DlqReason::Malformed => "malformed",
            DlqReason::SchemaViolation => "schema_violation",
            DlqReason::UnsupportedVersion => "unsupported_version",
            DlqReason::UnsupportedModel => "unsupported_model",
            DlqReason::TooLarge => "too_large",
            DlqReason::ResourceExhausted => "resource_exhausted",
            DlqReason::ModelError => "model_error",
            DlqReason::StorageRejected => "storage_rejected",
            DlqReason::RetriesExhausted => "retries_exhausted",
            DlqReason::Crashed => "crashed",
            DlqReason::IdempotencyConflict => "idempotency_conflict",
        }
    }

    pub fn parse(s: &str) -> Option<DlqReason> {
        DlqReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for DlqReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Kafka headers as read: name and optional value bytes, in order.
pub type RawHeaders = Vec<(String, Option<Vec<u8>>)>;

/// A header of the original record, kept byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OriginalHeader {
    pub key: String,
    pub value_base64: Option<String>,
}

/// The dead-lettered record as it was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OriginalRecord {
    #[serde(default)]
    pub key_base64: Option<String>,
    pub value_base64: String,
    pub headers: Vec<OriginalHeader>,
    #[serde(default)]
    pub timestamp_ms: Option<i64>,
}

impl OriginalRecord {
    pub fn new(key: Option<&[u8]>, value: &[u8], headers: &[(String, Option<Vec<u8>>)], timestamp_ms: Option<i64>) -> Self {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        OriginalRecord {
            key_base64: key.map(|k| b64.encode(k)),
            value_base64: b64.encode(value),
            headers: headers
                .iter()
                .map(|(k, v)| OriginalHeader {
                    key: k.clone(),
                    value_base64: v.as_ref().map(|v| b64.encode(v)),
                })
                .collect(),
            timestamp_ms,
        }
    }

    /// The original value bytes.
    pub fn value(&self) -> Result<Vec<u8>, base64::DecodeError> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.decode(&self.value_base64)
    }

    /// The original key bytes, if the record had a key.
    pub fn key(&self) -> Result<Option<Vec<u8>>, base64::DecodeError> {
        use base64::Engine as _;
        self.key_base64
            .as_ref()
            .map(|k| base64::engine::general_purpose::STANDARD.decode(k))
            .transpose()
    }

    /// The original headers.
    pub fn headers(&self) -> Result<RawHeaders, base64::DecodeError> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        self.headers
            .iter()
            .map(|h| Ok((h.key.clone(), h.value_base64.as_ref().map(|v| b64.decode(v)).transpose()?)))
            .collect()
    }
}

/// A record on the DLQ topic (`dlq.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqRecord {
    pub version: u32,
    pub reason: DlqReason,
    pub message: String,
    pub attempts: u32,
    #[serde(default)]
    pub task_id: Option<Uuid>,
    pub source: SourceRef,
    pub first_failed_at: DateTime<Utc>,
    pub last_failed_at: DateTime<Utc>,
    pub worker_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Map<String, Value>>,
    pub original: OriginalRecord,
}

/// Stored beside a task's images, written after all of them (`manifest.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultManifest {
    pub version: u32,
    pub task_id: Uuid,
    pub outputs: Vec<OutputRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_ms: Option<u64>,
    pub created_at: DateTime<Utc>,
    pub worker_id: String,
    /// The request hash of an idempotent task (its record's `idempotency.request_sha256`): a
    /// later record of the same task id with another hash is another request, not a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_sha256: Option<String>,
}

/// What a progress record reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProgressEvent {
    /// A worker started running the task: from step 0, or from the step its step checkpoint
    /// reached (`step`).
    Started,
    /// The task finished step `step` of `steps`.
    Step,
}

/// A record on the progress topic (`progress.schema.json`), keyed by task id. At most one step
/// record per 500 ms per task, plus the last step; nothing here is needed for correctness
/// (completions and DLQ records are the outcomes), so workers publish them without waiting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressRecord {
    pub version: u32,
    pub task_id: Uuid,
    pub model: String,
    pub worker_id: String,
    pub event: ProgressEvent,
    pub step: u32,
    pub steps: u32,
    pub at: DateTime<Utc>,
}

/// What a control record asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlAction {
    Cancel,
}

/// A record on the control topic (`control.schema.json`), keyed by task id. Every worker reads
/// the whole topic (not as a group member), so whoever holds the task sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlRecord {
    pub version: u32,
    pub task_id: Uuid,
    pub tenant: String,
    pub action: ControlAction,
    pub at: DateTime<Utc>,
}

/// A webhook event (`webhook.schema.json#/$defs/event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookEvent {
    /// A worker began the task.
    Started,
    /// A step finished (throttled, delivered once, never retried).
    Progress,
    /// The task ended: succeeded, failed, cancelled or expired (retried until the schedule ends).
    Completed,
}

impl WebhookEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookEvent::Started => "started",
            WebhookEvent::Progress => "progress",
            WebhookEvent::Completed => "completed",
        }
    }
}

fn completed_only() -> Vec<WebhookEvent> {
    vec![WebhookEvent::Completed]
}

/// Where a task's events are pushed (`webhook.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    pub url: String,
    #[serde(default = "completed_only")]
    pub events: Vec<WebhookEvent>,
}

/// A pending retry of a webhook event, on the retry topic (`webhook-delivery.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookDelivery {
    pub version: u32,
    pub event_id: String,
    pub event: WebhookEvent,
    pub task_id: Uuid,
    pub tenant: String,
    pub url: String,
    pub attempt: u32,
    pub due_at: DateTime<Utc>,
    pub first_attempt_at: DateTime<Utc>,
    pub last_error: String,
    pub payload: Map<String, Value>,
}

/// Why a webhook event was given up (`webhook-dlq.schema.json#/properties/reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFailure {
    /// The URL or its address is not allowed (SSRF guard).
    Refused,
    /// The receiver answered 410: nothing more goes to that URL.
    Gone,
    /// An answer that is not retried: a 3xx, or a 4xx other than 408 and 429.
    Rejected,
    /// Every attempt of the retry schedule failed.
    Exhausted,
}

impl WebhookFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookFailure::Refused => "refused",
            WebhookFailure::Gone => "gone",
            WebhookFailure::Rejected => "rejected",
            WebhookFailure::Exhausted => "exhausted",
        }
    }
}

/// A webhook event that was given up, on the webhook DLQ (`webhook-dlq.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookDlqRecord {
    pub version: u32,
    pub event_id: String,
    pub event: WebhookEvent,
    pub task_id: Uuid,
    pub tenant: String,
    pub url: String,
    pub attempts: u32,
    pub first_attempt_at: DateTime<Utc>,
    pub failed_at: DateTime<Utc>,
    pub reason: WebhookFailure,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_status: Option<u16>,
    pub payload: Map<String, Value>,
}
