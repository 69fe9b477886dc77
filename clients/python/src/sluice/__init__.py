"""Sluice's Python client.

    import sluice
    client = sluice.Client()                       # SLUICE_URL, SLUICE_API_KEY
    task = client.submit("sd-turbo", "a lighthouse at dusk", steps=4)
    for image in task.images(timeout=120):
        image.save(f"{task.id}-{image.index}.png")

`sluice.aio` holds the asyncio twins, `sluice.webhooks` the signature check, `sluice.kafka` the
completion-topic consumer (the `kafka` extra).
"""

from ._protocol import BatchProgress, Event, Image, Retries
from .aio import AsyncClient, AsyncTask
from .client import Client, Task
from .errors import (
    AlreadyFinished,
    APIError,
    AuthenticationError,
    BadRequest,
    ConnectionFailed,
    FieldError,
    IdempotencyConflict,
    ImageIntegrityError,
    ImagesNotReachable,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RecordDecodeError,
    ServerError,
    ServiceUnavailable,
    SluiceError,
    StreamsFailing,
    TaskNotSucceeded,
    WaitTimeout,
    WebhookVerificationError,
)
from .types import CompletionEvent, DlqRecord, ModelInfo, Output, TaskStatus

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "AlreadyFinished",
    "AsyncClient",
    "AsyncTask",
    "AuthenticationError",
    "BadRequest",
    "BatchProgress",
    "Client",
    "ConnectionFailed",
    "CompletionEvent",
    "DlqRecord",
    "Event",
    "FieldError",
    "IdempotencyConflict",
    "Image",
    "ImageIntegrityError",
    "ImagesNotReachable",
    "ModelInfo",
    "NotFound",
    "Output",
    "PayloadTooLarge",
    "RateLimited",
    "RecordDecodeError",
    "Retries",
    "ServerError",
    "ServiceUnavailable",
    "SluiceError",
    "StreamsFailing",
    "Task",
    "TaskNotSucceeded",
    "TaskStatus",
    "WaitTimeout",
    "WebhookVerificationError",
]
