"""What the sync and the async client share: settings, request bodies, the retry rule, error
decoding, Server-Sent Events parsing and image checks. No I/O here."""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import httpx

from .errors import (
    APIError,
    ConnectionFailed,
    ImageIntegrityError,
    ImagesNotReachable,
    NotFound,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    SluiceError,
    StreamsFailing,
    TaskNotSucceeded,
    WaitTimeout,
    error_from_body,
)
from .types import TERMINAL_STATES, Output, TaskStatus, WebhookSpec

USER_AGENT = "sluice-client-python/0.1.0"

# The endpoints the client calls, checked against the producer's OpenAPI document by the
# contract test.
ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("post", "/v1/tasks"),
    ("get", "/v1/tasks"),
    ("get", "/v1/tasks/{id}"),
    ("get", "/v1/tasks/{id}/events"),
    ("post", "/v1/tasks/{id}/cancel"),
    ("get", "/v1/models"),
)

# Answers worth trying again: busy, overloaded or briefly unreachable. A submission is retried
# only because it carries an idempotency key (the client sets one when the caller does not).
RETRY_STATUSES = frozenset({429, 502, 503, 504})

# How long a task just accepted may still be unknown to the status view (it reads the tasks
# topic after the broker acknowledged the record).
UNKNOWN_GRACE = 30.0


# What makes `wait` give up on the event stream and poll instead.
STREAM_FALLBACK = (httpx.TransportError, ConnectionFailed, RateLimited, ServiceUnavailable, ServerError, StreamsFailing)


@dataclass(frozen=True)
class Retries:
    """How a request that was answered 429/502/503/504, or not answered, is retried.

    `Retry-After` is honoured, up to `max_delay` seconds per wait; without it the wait doubles
    from `backoff` with jitter. At most `max_retries` retries per request.
    """

    max_retries: int = 5
    backoff: float = 0.25
    max_delay: float = 20.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return max(0.0, min(retry_after, self.max_delay))
        return min(self.backoff * (2.0**attempt), self.max_delay) * random.uniform(0.5, 1.0)


class Attempts:
    """The retry rule applied to one request: after each try, how long to wait before the next
    one, or the error that ends it."""

    def __init__(self, retries: Retries, what: str) -> None:
        self._retries = retries
        self._what = what
        self._attempt = 0

    def _next(self, retry_after: float | None) -> float:
        delay = self._retries.delay(self._attempt, retry_after)
        self._attempt += 1
        return delay

    def after_transport_error(self, error: httpx.TransportError) -> float:
        """The wait before trying again, or `ConnectionFailed` once the retries are spent."""
        if self._attempt >= self._retries.max_retries:
            raise ConnectionFailed(f"{self._what}: {error}") from error
        return self._next(None)

    def after_answer(self, response: httpx.Response, error_of: Callable[[httpx.Response], SluiceError]) -> float | None:
        """`None` for an answer that stands (below 400); the wait before trying again after a
        429/502/503/504 (`Retry-After` honoured); else raises `error_of(response)`."""
        if response.status_code < 400:
            return None
        if response.status_code in RETRY_STATUSES and self._attempt < self._retries.max_retries:
            return self._next(retry_after(response.headers))
        raise error_of(response)


class Following:
    """Following one task to its end, the same for both twins: its deadline, where its event
    stream resumes, and after each stream, failed connection or poll, how long to wait before
    the next or what to raise."""

    def __init__(self, task_id: str, timeout: float | None, retries: Retries, unknown_until: float) -> None:
        self._task_id = task_id
        self._timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._retries = retries
        # A fresh submission may be unknown to the status view until then.
        self._unknown_until = unknown_until
        self.last_id: str | None = None
        self._last_status: str | None = None
        self._failures = 0
        self._got = False

    def _timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _timeout_error(self) -> WaitTimeout:
        return WaitTimeout(self._task_id, self._timeout or 0.0, self._last_status)

    def connecting(self) -> None:
        """Before each connection to the stream: raises `WaitTimeout` past the deadline."""
        if self._timed_out():
            raise self._timeout_error()
        self._got = False

    def seen(self, status: TaskStatus, event_id: str | None = None) -> None:
        """A state of the task, from an event (its id is where a stream resumes) or a poll."""
        self._last_status = status["status"]
        if event_id is not None:
            self.last_id, self._got, self._failures = event_id, True, 0

    def after_stream(self) -> float:
        """A stream ended before the task did: reconnect at once after one that had events; wait
        longer after each that ended at once, and raise `StreamsFailing` once that keeps on."""
        if self._got or self._timed_out():
            return 0.0
        return self._failed(None, StreamsFailing(f"the event stream of task {self._task_id} keeps ending at once"))

    def unknown(self, error: NotFound) -> None:
        """The status view does not know the task: raises `error` unless it was just submitted."""
        if time.monotonic() > self._unknown_until:
            raise error

    def after_error(self, error: httpx.TransportError | APIError) -> float:
        """A connection that failed: the wait before the next, or the error raised (an answer not
        worth retrying, or any once the retries are spent)."""
        if isinstance(error, NotFound):
            self.unknown(error)
            return 0.2
        if isinstance(error, APIError):
            if error.status not in RETRY_STATUSES:
                raise error
            return self._failed(error.retry_after, error)
        spent = ConnectionFailed(f"the event stream of task {self._task_id}: {error}")
        spent.__cause__ = error
        return self._failed(None, spent)

    def _failed(self, retry_after: float | None, spent: SluiceError) -> float:
        self._failures += 1
        if self._failures > self._retries.max_retries:
            raise spent
        return self._retries.delay(self._failures - 1, retry_after)

    def before_poll(self, interval: float) -> float:
        """The wait before the next poll, or `WaitTimeout` when it would end past the deadline."""
        if self.deadline is not None and time.monotonic() + interval > self.deadline:
            raise self._timeout_error()
        return interval


@dataclass(frozen=True)
class Settings:
    url: str
    api_key: str | None
    timeout: httpx.Timeout
    retries: Retries
    user: str | None
    headers: dict[str, str] = field(default_factory=dict)


def settings(
    url: str | None,
    api_key: str | None,
    timeout: float | httpx.Timeout,
    retries: Retries | None,
    user: str | None,
) -> Settings:
    """The client's settings; `url` and `api_key` default to `SLUICE_URL` and `SLUICE_API_KEY`."""
    url = url or os.environ.get("SLUICE_URL")
    if not url:
        raise SluiceError("no producer URL: pass url= or set SLUICE_URL")
    api_key = api_key if api_key is not None else os.environ.get("SLUICE_API_KEY")
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
    return Settings(url.rstrip("/"), api_key, timeout, retries or Retries(), user, headers)


def submission(
    model: str,
    prompt: str | None,
    params: Mapping[str, Any],
    *,
    webhook: str | WebhookSpec | None,
    deadline: str | None,
    ttl_seconds: int | None,
    priority: str | None = None,
) -> dict[str, Any]:
    """The body of `POST /v1/tasks`: the request's fields as the schema names them."""
    body: dict[str, Any] = {"model": model}
    if prompt is not None:
        body["prompt"] = prompt
    body.update(params)
    if webhook is not None:
        body["webhook"] = {"url": webhook} if isinstance(webhook, str) else dict(webhook)
    if deadline is not None:
        body["deadline"] = deadline
    if ttl_seconds is not None:
        body["ttl_seconds"] = ttl_seconds
    if priority is not None:
        body["priority"] = priority
    return body


def submission_headers(idempotency_key: str | None, user: str | None) -> dict[str, str]:
    """A submission's headers: its idempotency key (a fresh one when the caller gives none, so
    that retries are safe) and the end user it is made for."""
    headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
    if user:
        headers["X-Sluice-User"] = user
    return headers


def retry_after(headers: httpx.Headers) -> float | None:
    """`Retry-After` in seconds (delta-seconds or an HTTP date), if present and readable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def api_error(response: httpx.Response) -> APIError:
    """The typed error of a 4xx/5xx answer whose body has been read."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return error_from_body(response.status_code, body, retry_after(response.headers))


def download_error(response: httpx.Response) -> SluiceError:
    """The error of a refused download of an output (the object store's answer, not JSON)."""
    return SluiceError(f"downloading an output: HTTP {response.status_code} from the object store")


def json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as e:
        raise SluiceError(f"{response.request.method} {response.request.url}: the answer is not JSON") from e


def is_terminal(status: TaskStatus) -> bool:
    return status["status"] in TERMINAL_STATES


EventType = Literal["status", "progress", "completed", "failed", "cancelled", "expired"]


@dataclass(frozen=True)
class Event:
    """One change of a task, from its event stream.

    `type`: `status` (queued or running), `progress` (a step of a multi-step model), or the end:
    `completed` (succeeded), `failed`, `cancelled` or `expired`. `task` is the task's whole state
    at that moment, the body `GET /v1/tasks/{id}` would give.
    """

    type: EventType
    id: str
    task: TaskStatus

    @property
    def terminal(self) -> bool:
        return is_terminal(self.task)


_END_TYPES: dict[str, EventType] = {
    "succeeded": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
    "expired": "expired",
}


def event_of(name: str, event_id: str, data: str) -> Event | None:
    """An `Event` from a Server-Sent Event of the task stream; `None` for other event names."""
    if name not in ("status", "progress", "completed"):
        return None
    task = cast(TaskStatus, json.loads(data))
    kind: EventType = _END_TYPES.get(task["status"], "completed") if name == "completed" else cast(EventType, name)
    return Event(kind, event_id, task)


class SSEDecoder:
    """The event-stream format (WHATWG HTML, "server-sent events"), a line at a time."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self._name = ""
        self._data: list[str] = []
        self._id: str | None = None

    def line(self, line: str) -> tuple[str, str, str] | None:
        """Feeds one line (without its end of line); returns `(event, id, data)` when a blank
        line ends an event."""
        if line == "":
            if not self._data:
                self._name, self._id = "", None
                return None
            name, data = self._name or "message", "\n".join(self._data)
            if self._id is not None:
                self.last_event_id = self._id
            event_id = self.last_event_id or ""
            self._name, self._data, self._id = "", [], None
            return name, event_id, data
        if line.startswith(":"):
            return None  # a comment: the producer's heartbeat
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            self._name = value
        elif key == "data":
            self._data.append(value)
        elif key == "id" and "\0" not in value:
            self._id = value
        return None


@dataclass(frozen=True)
class Image:
    """A downloaded output image, checked against the size and SHA-256 its task announced."""

    index: int
    content_type: str
    width: int
    height: int
    sha256: str
    data: bytes

    def save(self, path: str | os.PathLike[str]) -> Path:
        target = Path(path)
        target.write_bytes(self.data)
        return target


def outputs_to_fetch(status: TaskStatus) -> list[Output]:
    """The outputs of a succeeded task, each with an HTTP URL to download it through."""
    if status["status"] != "succeeded":
        error = status.get("error")
        raise TaskNotSucceeded(
            status["task_id"],
            status["status"],
            error["reason"] if error else None,
            error["message"] if error else None,
        )
    for output in status["outputs"]:
        if not output["url"].startswith(("http://", "https://")):
            raise ImagesNotReachable(
                f"output {output['index']} of task {status['task_id']} is at {output['url']}, not a presigned "
                "HTTP URL: read it from the object store with its own credentials"
            )
    return list(status["outputs"])


def image_of(output: Output, data: bytes) -> Image:
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != output["bytes"] or digest != output["sha256"]:
        raise ImageIntegrityError(
            f"output {output['index']}: {len(data)} bytes with SHA-256 {digest}, "
            f"announced {output['bytes']} bytes with {output['sha256']}"
        )
    return Image(output["index"], output["content_type"], output["width"], output["height"], digest, data)


@dataclass(frozen=True)
class BatchProgress:
    """How far a `submit_many` is: requests answered (accepted or refused) of all."""

    done: int
    total: int
    failed: int


def batch_key(prefix: str | None, index: int, request: Mapping[str, Any]) -> str | None:
    """A batch request's idempotency key: its own, or `<prefix>-<index>` so that running the
    same batch again submits nothing twice, or none (a fresh one per request)."""
    own = request.get("idempotency_key")
    if isinstance(own, str):
        return own
    return f"{prefix}-{index}" if prefix else None


def batch_fields(request: Mapping[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """`(model, prompt, other fields)` of a batch request."""
    rest = {k: v for k, v in request.items() if k not in ("model", "prompt", "idempotency_key")}
    model = request.get("model")
    if not isinstance(model, str):
        raise SluiceError(f"a batch request without a model: {dict(request)!r}")
    prompt = request.get("prompt")
    return model, prompt if isinstance(prompt, str) else None, rest
