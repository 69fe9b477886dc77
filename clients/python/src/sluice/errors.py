"""Typed errors, built from the producer's JSON error body (`error.schema.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class SluiceError(Exception):
    """Every error this package raises."""


@dataclass(frozen=True)
class FieldError:
    """What is wrong with one field: a dotted path into the body (`params.difficulty`), a header
    or query parameter name, or empty for the body as a whole."""

    field: str
    message: str


class APIError(SluiceError):
    """An answer of 4xx or 5xx. `code` is the stable machine-readable `error` of the body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        fields: tuple[FieldError, ...] = (),
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields
        self.retry_after = retry_after
        named = "; ".join(f"{f.field or '(body)'}: {f.message}" for f in fields)
        super().__init__(f"{status} {code}: {message}" + (f" [{named}]" if named else ""))

    def field(self, name: str) -> FieldError | None:
        """The error of field `name`, if the answer names it."""
        return next((f for f in self.fields if f.field == name), None)


class BadRequest(APIError):
    """400: not JSON, or invalid fields (each in `fields`), or a refused webhook."""


class AuthenticationError(APIError):
    """401: no valid API key."""


class NotFound(APIError):
    """404: no such task of the caller's tenant."""


class AlreadyFinished(APIError):
    """409: the task to cancel already finished."""


class PayloadTooLarge(APIError):
    """413: the body is larger than the producer reads."""


class IdempotencyConflict(APIError):
    """422: the `Idempotency-Key` belongs to another request, or is being used by one now."""


class RateLimited(APIError):
    """429: too many requests or event streams; `retry_after` says when to come back."""


class ServiceUnavailable(APIError):
    """503: the broker did not acknowledge in time, the producer is busy reading bodies, or its
    status view is still catching up; `retry_after` says when to come back."""


class ServerError(APIError):
    """Another 5xx."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: AuthenticationError,
    404: NotFound,
    409: AlreadyFinished,
    413: PayloadTooLarge,
    422: IdempotencyConflict,
    429: RateLimited,
    503: ServiceUnavailable,
}


def error_from_body(status: int, body: Any, retry_after: float | None) -> APIError:
    """The typed error of an answer: its class from the status, its facts from the JSON body
    (a body that is not the error shape keeps the status and its text)."""
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else APIError)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        fields = tuple(
            FieldError(str(f.get("field", "")), str(f.get("message", "")))
            for f in body.get("fields") or []
            if isinstance(f, dict)
        )
        return cls(status, body["error"], str(body.get("message", "")), fields, retry_after)
    text = body if isinstance(body, str) else ""
    return cls(status, "http_error", text[:500] or f"HTTP {status}", (), retry_after)


class ConnectionFailed(SluiceError):
    """The producer (or the object store) could not be reached, after the retries."""


class StreamsFailing(SluiceError):
    """A task's event stream keeps ending without an event."""


class WaitTimeout(SluiceError, TimeoutError):
    """A task did not finish within the time `wait` was given."""

    def __init__(self, task_id: str, timeout: float, last_status: str | None) -> None:
        self.task_id = task_id
        self.timeout = timeout
        self.last_status = last_status
        super().__init__(f"task {task_id} did not finish within {timeout:g} s (last seen: {last_status or 'unknown'})")


class TaskNotSucceeded(SluiceError):
    """The images of a task that did not succeed were asked for."""

    def __init__(self, task_id: str, status: str, reason: str | None, message: str | None) -> None:
        self.task_id = task_id
        self.status = status
        self.reason = reason
        super().__init__(f"task {task_id} is {status}" + (f" ({reason}: {message})" if reason else ""))


class ImageIntegrityError(SluiceError):
    """A downloaded image does not match the size or SHA-256 its completion announced."""


class ImagesNotReachable(SluiceError):
    """An output has no presigned HTTP URL (the producer does not presign for this store)."""


class WebhookVerificationError(SluiceError):
    """A webhook delivery whose signature, timestamp or headers do not verify."""


class RecordDecodeError(SluiceError):
    """A record of the completion or DLQ topic that is not the schema's JSON. The consumer is
    left before it: call `Completions.skip(error)` to commit past it, or it comes again."""

    def __init__(self, message: str, topic: str = "", partition: int = -1, offset: int = -1, value: bytes | None = None) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.value = value
        super().__init__(message)
