"""Webhook signatures, per Standard Webhooks (https://www.standardwebhooks.com/).

Each delivery carries `webhook-id` (the same on every attempt of one event), `webhook-timestamp`
(Unix seconds of the attempt) and `webhook-signature`: space-separated `v1,<base64>` entries,
each the HMAC-SHA256 of `"{id}.{timestamp}.{body}"` under one of the tenant's secrets (several
while secrets rotate).

    from sluice.webhooks import verify
    task = verify(request.headers, await request.body(), "whsec_...")
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from typing import cast

from .errors import WebhookVerificationError
from .types import TaskStatus

DEFAULT_TOLERANCE = 300.0
"""Seconds a delivery's timestamp may be off the receiver's clock, either way (replays)."""


def _key(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    encoded = secret.removeprefix("whsec_")
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error as e:
        raise ValueError("a webhook secret is `whsec_<base64>` (or the key's bytes)") from e


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    raise WebhookVerificationError(f"missing header {name}")


def sign(secret: str | bytes, msg_id: str, timestamp: int | str, body: bytes) -> str:
    """The `v1,<base64>` signature of a delivery under `secret`."""
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def verify(
    headers: Mapping[str, str],
    body: bytes | str,
    secret: str | bytes | Sequence[str | bytes],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> TaskStatus:
    """Checks a delivery and returns its body, the task's status.

    `headers` is any mapping of the request's headers (names compared case-insensitively),
    `body` the raw body exactly as received (before any JSON parsing), `secret` one secret or
    several (`whsec_<base64>`, as configured in `SLUICE_WEBHOOK_SECRETS`): a signature made with
    any of them is accepted. Raises `WebhookVerificationError` for a missing header, a timestamp
    more than `tolerance` seconds off, or no matching signature. Signatures are compared in
    constant time. Deduplicate deliveries by `webhook-id`: a retried event keeps its id.
    """
    raw = body.encode() if isinstance(body, str) else body
    msg_id = _header(headers, "webhook-id")
    stamp = _header(headers, "webhook-timestamp")
    signatures = _header(headers, "webhook-signature")
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 12:
        raise WebhookVerificationError(f"webhook-timestamp is not Unix seconds: {stamp[:40]!r}")
    timestamp = int(stamp)
    clock = time.time() if now is None else now
    if abs(clock - timestamp) > tolerance:
        raise WebhookVerificationError(f"webhook-timestamp {timestamp} is more than {tolerance:g} s off the clock")
    secrets = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    if not secrets:
        raise ValueError("no webhook secret given")
    expected = [sign(s, msg_id, stamp, raw).encode() for s in secrets]  # the header as sent
    matched = False
    for candidate in signatures.split():
        if not candidate.startswith("v1,"):
            continue  # another scheme: not ours to judge
        for want in expected:
            # Every comparison runs: how many entries match does not show in the time taken.
            matched |= hmac.compare_digest(candidate.encode(), want)
    if not matched:
        raise WebhookVerificationError("no webhook-signature matches a configured secret")
    try:
        return cast(TaskStatus, json.loads(raw))
    except ValueError as e:
        raise WebhookVerificationError("the signed body is not JSON") from e
