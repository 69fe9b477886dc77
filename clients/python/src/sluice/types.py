"""The JSON shapes of Sluice's API and topics, as typed dictionaries.

Each mirrors one JSON Schema of the repository's `schemas/v1/` (named in its docstring); a
contract test holds the keys, the required keys and the enums against those files, so the two
cannot drift. Values are what the JSON holds: timestamps stay RFC 3339 strings.
"""

from __future__ import annotations

from typing import Literal, TypedDict

TaskState = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
"""`task-status.schema.json#/properties/status`."""

TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "expired"})

CompletionState = Literal["succeeded", "failed", "cancelled", "expired"]
"""`completion.schema.json#/properties/status`."""

DlqReason = Literal[
    "malformed",
    "schema_violation",
    "unsupported_version",
    "unsupported_model",
    "too_large",
    "resource_exhausted",
    "model_error",
    "storage_rejected",
    "retries_exhausted",
    "crashed",
    "idempotency_conflict",
]
"""`dlq.schema.json#/$defs/reason`: why a task was dead-lettered."""

Sampler = Literal["onestep", "euler", "euler_a", "ddim", "dpmpp_2m", "dpmpp_2m_karras", "lcm", "flow_euler"]
# A task's lane: workers take interactive work first and batch work last.
Priority = Literal["interactive", "standard", "batch"]
"""`generation.schema.json#/$defs/generation/properties/sampler`."""

WebhookEvent = Literal["started", "progress", "completed"]
"""`webhook.schema.json#/$defs/event`."""

class Output(TypedDict):
    """An image of a finished task (`completion.schema.json#/properties/outputs/items`)."""

    index: int
    url: str
    key: str
    content_type: str
    bytes: int
    sha256: str
    width: int
    height: int


class TaskError(TypedDict):
    """Why a task failed (`completion.schema.json#/properties/error`)."""

    reason: DlqReason
    message: str


class Timings(TypedDict):
    """Milliseconds (`completion.schema.json#/properties/timings`)."""

    queued_ms: int
    inference_ms: int
    upload_ms: int
    total_ms: int


class _ProgressRequired(TypedDict):
    step: int
    steps: int


class Progress(_ProgressRequired, total=False):
    """Steps of a multi-step model (`task-status.schema.json#/properties/progress`);
    `resumed_from`: the step a task carried on from, its step checkpoint's."""

    resumed_from: int


class TaskStatus(TypedDict):
    """A task as the status view holds it (`task-status.schema.json`): `GET /v1/tasks/{id}`,
    each Server-Sent Event's data and every webhook delivery's body."""

    task_id: str
    status: TaskState
    model: str
    created_at: str
    updated_at: str
    progress: Progress | None
    outputs: list[Output]
    error: TaskError | None
    timings: Timings | None
    attempt: int


class _TaskPageRequired(TypedDict):
    tasks: list[TaskStatus]


class TaskPage(_TaskPageRequired, total=False):
    """A page of `GET /v1/tasks` (`task-page.schema.json`)."""

    next_cursor: str


class Range(TypedDict):
    """Bounds and default of a numeric parameter (`model-list.schema.json#/$defs/range`)."""

    min: float
    max: float
    default: float


class ModelInfo(TypedDict):
    """A served model (`model-list.schema.json#/properties/models/items`)."""

    name: str
    kind: str
    width: Range
    height: Range
    size_multiple: int
    steps: Range
    guidance_scale: Range
    samplers: list[str]
    default_sampler: str
    max_num_images: int
    max_prompt_chars: int
    max_ttl_seconds: int
    max_task_pixels: int
    max_task_rows: int
    modes: list[Literal["text", "img2img", "inpaint"]]
    negative_prompt: bool


class Source(TypedDict):
    """Where a task's record was read (`dlq.schema.json#/$defs/source`)."""

    topic: str
    partition: int
    offset: int


class _CompletionRequired(TypedDict):
    version: Literal[1]
    task_id: str
    status: CompletionState
    model: str
    tenant: str
    outputs: list[Output]
    timings: Timings
    worker_id: str
    attempt: int
    completed_at: str
    source: Source


class CompletionEvent(_CompletionRequired, total=False):
    """A record of the completion topic (`completion.schema.json`): one per finished attempt."""

    user: str | None
    error: TaskError | None


class _HeaderRequired(TypedDict):
    key: str
    value_base64: str | None


class _OriginalRequired(TypedDict):
    value_base64: str
    headers: list[_HeaderRequired]


class OriginalRecord(_OriginalRequired, total=False):
    """The dead-lettered record, byte for byte (`dlq.schema.json#/properties/original`)."""

    key_base64: str | None
    timestamp_ms: int | None


class _DlqRequired(TypedDict):
    version: Literal[1]
    reason: DlqReason
    message: str
    attempts: int
    source: Source
    first_failed_at: str
    last_failed_at: str
    worker_id: str
    original: OriginalRecord


class DlqRecord(_DlqRequired, total=False):
    """A record of the dead-letter topic (`dlq.schema.json`)."""

    task_id: str | None
    details: dict[str, object]


class _WebhookRequired(TypedDict):
    url: str


class WebhookSpec(_WebhookRequired, total=False):
    """Where a task's events are pushed (`webhook.schema.json`)."""

    events: list[WebhookEvent]


JSONValue = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
