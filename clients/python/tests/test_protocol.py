"""Unit tests of what needs no stack: the event-stream parser, error decoding, the retry rule
(over httpx's in-process transport), webhook signatures, record decoding."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest

import sluice
from sluice import _protocol as p
from sluice import webhooks
from sluice.kafka import Completions, decode


def test_the_event_stream_parser_follows_the_format() -> None:
    decoder = p.SSEDecoder()
    lines = [
        ": heartbeat",
        "event: status",
        "id: 1-queued-0",
        'data: {"a":',
        "data: 1}",
        "",
        "",
        "data: no name",
        "",
        "event: progress",
        'data: {"b":2}',
        "",
    ]
    events = [e for e in (decoder.line(line) for line in lines) if e is not None]
    assert events == [
        ("status", "1-queued-0", '{"a":\n1}'),
        ("message", "1-queued-0", "no name"),  # the last id carries over
        ("progress", "1-queued-0", '{"b":2}'),
    ]


def _status(state: str) -> dict[str, Any]:
    return {
        "task_id": "t",
        "status": state,
        "model": "m",
        "created_at": "x",
        "updated_at": "x",
        "progress": None,
        "outputs": [],
        "error": None,
        "timings": None,
        "attempt": 1,
    }


@pytest.mark.parametrize(
    ("name", "state", "kind", "terminal"),
    [
        ("status", "queued", "status", False),
        ("progress", "running", "progress", False),
        ("completed", "succeeded", "completed", True),
        ("completed", "failed", "failed", True),
        ("completed", "cancelled", "cancelled", True),
        ("completed", "expired", "expired", True),
    ],
)
def test_events_are_typed_by_what_they_say(name: str, state: str, kind: str, terminal: bool) -> None:
    event = p.event_of(name, "id", json.dumps(_status(state)))
    assert event is not None and event.type == kind and event.terminal is terminal
    assert p.event_of("message", "id", "{}") is None


def test_errors_are_typed_from_the_json_body() -> None:
    body = {
        "error": "invalid_request",
        "message": "2 fields",
        "fields": [{"field": "steps", "message": "at most 50"}, {"field": "params.difficulty", "message": "an integer"}],
    }
    e = sluice.errors.error_from_body(400, body, None)
    assert isinstance(e, sluice.BadRequest) and e.code == "invalid_request"
    assert e.field("params.difficulty") == sluice.FieldError("params.difficulty", "an integer")
    assert "steps: at most 50" in str(e)
    busy = sluice.errors.error_from_body(503, {"error": "busy", "message": "m", "fields": []}, 2.0)
    assert isinstance(busy, sluice.ServiceUnavailable) and busy.retry_after == 2.0
    assert isinstance(sluice.errors.error_from_body(502, "<html>bad gateway</html>", None), sluice.ServerError)
    assert isinstance(sluice.errors.error_from_body(422, {"error": "idempotency_conflict", "message": "", "fields": []}, None), sluice.IdempotencyConflict)


def test_retry_after_reads_seconds_and_dates() -> None:
    assert p.retry_after(httpx.Headers({"Retry-After": "3"})) == 3.0
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 60))
    later = p.retry_after(httpx.Headers({"Retry-After": soon}))
    assert later is not None and 50 < later <= 61
    assert p.retry_after(httpx.Headers({"Retry-After": "soon"})) is None
    assert p.Retries(max_delay=5).delay(0, 60.0) == 5.0  # bounded


def _client(handler: Any, **kwargs: Any) -> sluice.Client:
    transport = httpx.MockTransport(handler)
    return sluice.Client("http://producer", "key", http_client=httpx.Client(transport=transport), **kwargs)


def test_a_busy_answer_is_retried_after_its_retry_after_with_the_same_idempotency_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) < 3:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": "busy", "message": "m", "fields": []})
        return httpx.Response(202, json={"task_id": "abc", "status": "queued"})

    task = _client(handler).submit("terrain", width=64, params={"difficulty": 3})
    assert task.id == "abc" and len(seen) == 3
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(keys) == 1, "a retry is the same submission"
    assert seen[0].headers["authorization"] == "Bearer key"
    assert json.loads(seen[0].content) == {"model": "terrain", "width": 64, "params": {"difficulty": 3}}


def test_retries_are_bounded_and_field_errors_are_not_retried() -> None:
    calls = 0

    def busy(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": "too_many_streams", "message": "m", "fields": []})

    with pytest.raises(sluice.RateLimited):
        _client(busy, retries=sluice.Retries(max_retries=2)).models()
    assert calls == 3

    calls = 0

    def invalid(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(400, json={"error": "invalid_request", "message": "m", "fields": [{"field": "model", "message": "unknown"}]})

    with pytest.raises(sluice.BadRequest) as refused:
        _client(invalid).submit("nope")
    assert calls == 1 and refused.value.fields[0].field == "model"


def test_submit_many_keeps_order_reports_progress_and_names_keys_by_index() -> None:
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        keys.append(request.headers["idempotency-key"])
        if body.get("prompt") == "bad":
            return httpx.Response(400, json={"error": "invalid_request", "message": "m", "fields": [{"field": "prompt", "message": "no"}]})
        return httpx.Response(202, json={"task_id": f"id-{body['seed']}", "status": "queued"})

    progress: list[sluice.BatchProgress] = []
    requests = [{"model": "m", "prompt": "bad" if i == 3 else "ok", "seed": i} for i in range(10)]
    results = _client(handler).submit_many(requests, concurrency=4, key_prefix="job", on_progress=progress.append)
    assert [r.id if isinstance(r, sluice.Task) else "refused" for r in results] == [
        "refused" if i == 3 else f"id-{i}" for i in range(10)
    ]
    assert sorted(keys) == sorted(f"job-{i}" for i in range(10))
    assert progress[-1] == sluice.BatchProgress(10, 10, 1)


def test_images_are_checked_against_their_announced_hash() -> None:
    output = {"index": 0, "url": "http://s3/x", "key": "x", "content_type": "image/png", "bytes": 3, "sha256": "0" * 64, "width": 1, "height": 1}
    with pytest.raises(sluice.ImageIntegrityError):
        p.image_of(output, b"abc")  # type: ignore[arg-type]
    failed = {**_status("failed"), "error": {"reason": "model_error", "message": "boom"}}
    with pytest.raises(sluice.TaskNotSucceeded) as e:
        p.outputs_to_fetch(failed)  # type: ignore[arg-type]
    assert e.value.reason == "model_error"


# The test vector of the Standard Webhooks specification's reference libraries.
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID, SPEC_TIMESTAMP = "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_webhook_signatures_follow_standard_webhooks() -> None:
    assert webhooks.sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    headers = {"Webhook-Id": SPEC_ID, "Webhook-Timestamp": str(SPEC_TIMESTAMP), "Webhook-Signature": f"v1a,xyz {SPEC_SIGNATURE}"}
    assert webhooks.verify(headers, SPEC_BODY, ["whsec_" + "A" * 32, SPEC_SECRET], now=SPEC_TIMESTAMP + 10) == {"test": 2432232314}  # type: ignore[comparison-overlap]
    refusals = [
        (headers, SPEC_BODY + b" ", SPEC_SECRET, SPEC_TIMESTAMP),  # the body changed
        (headers, SPEC_BODY, "whsec_" + "A" * 32, SPEC_TIMESTAMP),  # another secret
        (headers, SPEC_BODY, SPEC_SECRET, SPEC_TIMESTAMP + 301),  # too late: a replay
        (headers, SPEC_BODY, SPEC_SECRET, SPEC_TIMESTAMP - 301),  # from the future
        ({k: v for k, v in headers.items() if k != "Webhook-Id"}, SPEC_BODY, SPEC_SECRET, SPEC_TIMESTAMP),
        ({**headers, "Webhook-Timestamp": "yesterday"}, SPEC_BODY, SPEC_SECRET, SPEC_TIMESTAMP),
        ({**headers, "Webhook-Signature": "v2," + SPEC_SIGNATURE[3:]}, SPEC_BODY, SPEC_SECRET, SPEC_TIMESTAMP),
    ]
    for h, body, secret, now in refusals:
        with pytest.raises(sluice.WebhookVerificationError):
            webhooks.verify(h, body, secret, now=now)


def test_records_decode_by_topic_and_refuse_what_is_not_the_schema() -> None:
    completion = json.dumps({"version": 1, "task_id": "t1", "status": "succeeded", "outputs": []}).encode()
    record = decode("sluice.completions.v1", 2, 40, 123, b"t1", completion, "sluice.dlq.v1")
    assert record.kind == "completion" and record.task_id == "t1" and record.dlq is None
    dlq = json.dumps({"version": 1, "reason": "crashed", "task_id": "t2", "original": {}}).encode()
    assert decode("sluice.dlq.v1", 0, 1, None, None, dlq, "sluice.dlq.v1").task_id == "t2"
    for bad in (b"not json", b'{"version": 2}', b'{"version": 1}'):
        with pytest.raises(sluice.RecordDecodeError):
            decode("sluice.completions.v1", 0, 0, None, None, bad, "sluice.dlq.v1")


class _LookupsFail:
    """The consumer the assign callback is handed, its lookups failing (a broker away)."""

    def __init__(self) -> None:
        self.assigned: list[Any] | None = None

    def committed(self, partitions: list[Any], timeout: float) -> list[Any]:
        raise RuntimeError("KafkaError{code=_TIMED_OUT}")

    def assign(self, partitions: list[Any]) -> None:
        self.assigned = partitions


def test_a_reader_that_cannot_find_where_from_time_starts_reads_nothing_and_says_so() -> None:
    kafka = pytest.importorskip("confluent_kafka")  # the kafka extra
    with Completions("127.0.0.1:1", "g", from_time=datetime.now(timezone.utc)) as reader:
        consumer = _LookupsFail()
        reader._on_assign(consumer, [kafka.TopicPartition("sluice.completions.v1", 0)])
        assert consumer.assigned == [], "not assigned from the group's commits or the beginning"
        for _ in range(2):
            with pytest.raises(sluice.SluiceError, match="from_time"):
                reader.poll(0)


def _sse(*events: tuple[str, str, dict[str, Any]]) -> bytes:
    return b"".join(f"event: {name}\nid: {eid}\ndata: {json.dumps(data)}\n\n".encode() for name, eid, data in events)


def test_a_cut_stream_is_resumed_with_last_event_id() -> None:
    asked: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("last-event-id"))
        if len(asked) == 1:
            return httpx.Response(200, content=_sse(("status", "1-queued-0", _status("queued"))))
        return httpx.Response(200, content=_sse(("completed", "2-succeeded-0", _status("succeeded"))))

    client = _client(handler, retries=sluice.Retries(backoff=0.0))
    assert [e.type for e in client.task("t").events(timeout=10)] == ["status", "completed"]
    assert asked == [None, "1-queued-0"]


def test_wait_polls_where_streams_are_refused() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": "too_many_streams", "message": "m", "fields": []})
        return httpx.Response(200, json=_status("succeeded"))

    client = _client(handler, retries=sluice.Retries(max_retries=1, backoff=0.0))
    assert client.task("t").wait(timeout=10, poll_interval=0.01)["status"] == "succeeded"


def test_only_a_fresh_submission_waits_for_the_status_view() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        if request.method == "POST":
            return httpx.Response(202, json={"task_id": "t", "status": "queued"})
        calls += 1
        if calls < 3:
            return httpx.Response(404, json={"error": "not_found", "message": "m", "fields": []})
        return httpx.Response(200, content=_sse(("completed", "1-succeeded-0", _status("succeeded"))))

    client = _client(handler)
    assert client.submit("m").wait(timeout=10)["status"] == "succeeded" and calls == 3
    with pytest.raises(sluice.NotFound):
        calls = 0
        client.task("t").wait(timeout=10)


def test_wait_times_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(200, content=_sse(("status", "1-running-0", _status("running"))))
        return httpx.Response(200, json=_status("running"))

    client = _client(handler, retries=sluice.Retries(backoff=0.01))
    started = time.monotonic()
    with pytest.raises(sluice.WaitTimeout) as e:
        client.task("t").wait(timeout=0.5, poll_interval=0.05)
    assert e.value.last_status == "running" and time.monotonic() - started < 3
