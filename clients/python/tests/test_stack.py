"""The client against a running deployment: a producer and two workers on the demo catalog.

Run by `make test` through `integration-tests/tests/python_client.rs`, which starts them and sets
`SLUICE_URL`, `SLUICE_API_KEY` and the `SLUICE_TEST_*` variables read here. The tests run in file
order; the last one kills a worker.
"""

from __future__ import annotations

import asyncio
import csv
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

import sluice
from sluice import _protocol as p
from sluice import types, webhooks
from sluice.aio import AsyncClient
from sluice.kafka import Completions, Record, completions

pytestmark = pytest.mark.stack

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent
URL = os.environ.get("SLUICE_URL", "")
SECRET = os.environ.get("SLUICE_TEST_WEBHOOK_SECRET", "")
BROKERS = os.environ.get("SLUICE_TEST_BROKERS", "")
HELD_SEED = int(os.environ.get("SLUICE_TEST_HELD_SEED", "0"))

if not URL:
    pytest.skip("needs a running deployment (make test runs this suite)", allow_module_level=True)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def sd(prompt: str, seed: int, **fields: Any) -> dict[str, Any]:
    return {"model": "sd-tiny", "prompt": prompt, "width": 64, "height": 64, "steps": 4, "seed": seed, **fields}


@pytest.fixture()
def client() -> Any:
    with sluice.Client() as c:
        yield c


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    readme = (PACKAGE / "README.md").read_text()
    block = readme.split("<!-- quickstart", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    assert len(block.splitlines()) <= 10, "a 10-line quick start"
    run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("succeeded"), run.stdout
    saved = list(tmp_path.glob("*.png"))
    assert len(saved) == 1 and png_size(saved[0].read_bytes()) == (64, 64)


def test_submit_wait_and_images(client: sluice.Client) -> None:
    task = client.submit("sd-tiny", "a red bicycle", width=96, height=64, steps=3, num_images=2, seed=11)
    status = task.wait(timeout=120)
    assert status["status"] == "succeeded" and status["task_id"] == task.id
    assert set(status) == set(types.TaskStatus.__annotations__)
    images = task.images()
    assert [i.index for i in images] == [0, 1]
    for image, output in zip(images, status["outputs"]):
        assert png_size(image.data) == (96, 64) == (image.width, image.height)
        assert image.sha256 == output["sha256"]
    # A terrain map, with its own parameters.
    terrain = client.submit("terrain", width=128, height=128, seed=3, params={"difficulty": 20})
    assert png_size(terrain.images(timeout=120)[0].data) == (128, 128)
    assert any(t["task_id"] == task.id for t in client.tasks(status="succeeded"))


def test_field_errors_name_their_fields(client: sluice.Client) -> None:
    for fields, name in (({"steps": 500}, "steps"), ({"width": 63}, "width"), ({"params": {"difficulty": "hard"}}, "params")):
        with pytest.raises(sluice.BadRequest) as refused:
            client.submit("sd-tiny", "x", **fields)
        assert refused.value.fields and refused.value.fields[0].field.startswith(name), refused.value
    with pytest.raises(sluice.BadRequest) as unknown:
        client.submit("no-such-model", "x")
    assert unknown.value.field("model") is not None
    with pytest.raises(sluice.AuthenticationError):
        sluice.Client(URL, "not-a-key").get(str(uuid.uuid4()))
    with pytest.raises(sluice.NotFound):
        client.get(str(uuid.uuid4()))


def test_models_are_the_catalog(client: sluice.Client) -> None:
    models = {m["name"]: m for m in client.models()}
    assert {"terrain", "sd-tiny", "sdxl-tiny", "flux-schnell-tiny"} <= set(models)
    assert set(models["sd-tiny"]) == set(types.ModelInfo.__annotations__)
    assert models["sd-tiny"]["steps"]["max"] == 20


def test_the_producers_openapi_document_has_what_the_client_calls() -> None:
    document = httpx.get(f"{URL}/openapi.json").json()
    for method, path in p.ENDPOINTS:
        assert method in document["paths"][path], (method, path)
    components = document["components"]["schemas"]
    assert set(components["TaskStatus"]["properties"]) == set(types.TaskStatus.__annotations__)
    assert set(components["Completion"]["properties"]) == set(types.CompletionEvent.__annotations__)
    assert set(components["Dlq"]["properties"]) == set(types.DlqRecord.__annotations__)
    sse = document["paths"]["/v1/tasks/{id}/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]
    assert set(sse["schema"]["properties"]["event"]["enum"]) == {"status", "progress", "completed"}


def test_events_follow_a_task_to_its_end(client: sluice.Client) -> None:
    task = client.submit("sd-tiny", "a lighthouse", steps=12, seed=21)
    events = list(task.events(timeout=120))
    kinds = [e.type for e in events]
    assert kinds[-1] == "completed" and events[-1].terminal, kinds
    assert all(not e.terminal for e in events[:-1]), kinds
    assert set(kinds[:-1]) <= {"status", "progress"}, kinds
    steps = [e.task["progress"]["step"] for e in events if e.task["progress"] is not None]
    assert steps == sorted(steps), "progress only moves forward"
    assert len({e.id for e in events}) == len(events), "each event its own id"


def test_cancel_a_running_task(client: sluice.Client) -> None:
    held = client.submit("sd-tiny", "held until cancelled", seed=HELD_SEED)
    for event in held.events(timeout=120):
        if event.task["status"] == "running":
            break
    held.cancel()
    final = held.wait(timeout=120)
    assert final["status"] == "cancelled" and final["outputs"] == []
    with pytest.raises(sluice.AlreadyFinished):
        held.cancel()
    with pytest.raises(sluice.TaskNotSucceeded):
        held.images()


def test_an_idempotent_retry_is_the_same_task(client: sluice.Client) -> None:
    key = f"retry-{uuid.uuid4()}"
    first = client.submit("sd-tiny", "a kettle", seed=5, idempotency_key=key)
    again = client.submit("sd-tiny", "a kettle", seed=5, idempotency_key=key)
    assert again.id == first.id
    with pytest.raises(sluice.IdempotencyConflict) as conflict:
        client.submit("sd-tiny", "another request", seed=5, idempotency_key=key)
    assert conflict.value.status == 422
    assert first.wait(timeout=120)["status"] == "succeeded"


def test_the_async_twin(tmp_path: Path) -> None:
    async def run() -> list[int]:
        async with AsyncClient() as client:
            tasks = await client.submit_many([sd("an async fox", seed=30 + i) for i in range(4)], concurrency=4)
            ready = [t for t in tasks if isinstance(t, sluice.AsyncTask)]
            assert len(ready) == 4, tasks
            kinds = [e.type async for e in ready[0].events(timeout=120)]
            assert kinds[-1] == "completed"
            finals = await asyncio.gather(*(t.wait(timeout=120) for t in ready))
            assert {f["status"] for f in finals} == {"succeeded"}
            images = await ready[1].images()
            return [len(i.data) for i in images]

    assert all(n > 0 for n in asyncio.run(run()))


class _Capture(http.server.BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        _Capture.received.append(({k: v for k, v in self.headers.items()}, body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def test_the_producers_webhook_signatures_verify(client: sluice.Client) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hook = f"http://127.0.0.1:{server.server_address[1]}/hook"
        task = client.submit("sd-tiny", "signed", seed=40, webhook={"url": hook, "events": ["started", "completed"]})
        task.wait(timeout=120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(b'"succeeded"' in b for _, b in _Capture.received):
            time.sleep(0.2)
    finally:
        server.shutdown()
    ours = [(h, b) for h, b in _Capture.received if task.id.encode() in b]
    assert ours, "the producer delivered"
    for headers, body in ours:
        status = webhooks.verify(headers, body, SECRET)
        assert status["task_id"] == task.id
        assert webhooks.verify(headers, body, ["whsec_" + "QUJD" * 8, SECRET])["task_id"] == task.id  # rotation
        with pytest.raises(sluice.WebhookVerificationError):
            webhooks.verify(headers, body, "whsec_" + "QUJD" * 8)
        with pytest.raises(sluice.WebhookVerificationError):
            webhooks.verify(headers, body + b" ", SECRET)
        with pytest.raises(sluice.WebhookVerificationError):
            webhooks.verify(headers, body, SECRET, now=int(headers["webhook-timestamp"]) + 3600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_fastapi_example_receives_verified_deliveries_once(client: sluice.Client, tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "webhooks.jsonl"
    env = {**os.environ, "SLUICE_WEBHOOK_SECRETS": SECRET, "WEBHOOK_LOG": str(log)}
    receiver = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "fastapi_webhook:app", "--port", str(port), "--log-level", "warning"],
        cwd=PACKAGE / "examples",
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/docs")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the receiver starts"
                time.sleep(0.2)
        forged = httpx.post(f"http://127.0.0.1:{port}/hook", content=b"{}", headers={"webhook-id": "x", "webhook-timestamp": str(int(time.time())), "webhook-signature": "v1,AAAA"})
        assert forged.status_code == 400
        task = client.submit("sd-tiny", "received", seed=41, webhook=f"http://127.0.0.1:{port}/hook")
        task.wait(timeout=120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (log.exists() and task.id in log.read_text()):
            time.sleep(0.2)
    finally:
        receiver.terminate()
        receiver.wait(10)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["task"]["status"] for line in lines if line["task"]["task_id"] == task.id] == ["succeeded"]


def test_the_batch_example_writes_its_csv_and_reruns_idempotently(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a batch prompt {i}\n" for i in range(20)))
    batch = f"batch-{uuid.uuid4()}"
    command = [sys.executable, str(PACKAGE / "examples/batch_csv.py"), str(prompts)]
    for out in ("first.csv", "again.csv"):
        run = subprocess.run([*command, str(tmp_path / out), "--batch-id", batch], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    first, again = (list(csv.DictReader((tmp_path / f).open())) for f in ("first.csv", "again.csv"))
    assert len(first) == 20 and {r["status"] for r in first} == {"succeeded"}
    assert [r["task_id"] for r in again] == [r["task_id"] for r in first], "nothing submitted twice"


def test_the_fanout_example(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(PACKAGE / "examples/fanout.py"), "a fan", "--variations", "4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert len(list(tmp_path.glob("*.png"))) == 4


class _AppendsWhileJoining(Completions):
    """A reader that has a record appended to its topic after it found where to start and
    before it starts fetching, as a busy worker's completions can be."""

    def __init__(self, append: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        self._append = append
        super().__init__(*args, **kwargs)

    def _start_at_time(self, consumer: Any, partitions: list[Any], from_ms: int) -> None:
        super()._start_at_time(consumer, partitions, from_ms)
        self._append()


def test_a_completion_appended_while_the_reader_joins_is_read() -> None:
    """`from_time` on a partition with nothing at or after it starts at the end found before the
    lookup, not at `OFFSET_END`, which librdkafka resolves when fetching starts: a record appended
    in between was skipped."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    topic = f"python-client-join-{uuid.uuid4()}"
    admin = AdminClient({"bootstrap.servers": BROKERS})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": BROKERS})

    def completion(task_id: str) -> None:
        body = {"version": 1, "task_id": task_id, "status": "succeeded", "outputs": []}
        producer.produce(topic, key=task_id.encode(), value=json.dumps(body).encode(), partition=0)
        assert producer.flush(30) == 0

    completion("before")
    time.sleep(0.05)
    started = datetime.now(timezone.utc)
    time.sleep(0.05)
    seen: list[str | None] = []
    with _AppendsWhileJoining(lambda: completion("while-joining"), BROKERS, f"python-client-{uuid.uuid4()}", topic=topic, dlq_topic=None, from_time=started) as reader:
        reader.run(lambda r: seen.append(r.task_id), idle_timeout=5)
    assert seen == ["while-joining"]


def test_the_completion_consumer_sees_each_task_once_across_a_worker_kill(client: sluice.Client) -> None:
    """Last: it kills a worker. Tasks in flight on it are run again by the other; read_committed,
    each task's completion is seen exactly once, committed after the handler returned."""
    pids = [int(pid) for pid in os.environ["SLUICE_TEST_WORKER_PIDS"].split(",")]
    started = datetime.now(timezone.utc)
    submitted = client.submit_many([sd("a kill test", seed=1000 + i, steps=8) for i in range(40)], concurrency=8)
    ids = {t.id for t in submitted if isinstance(t, sluice.Task)}
    assert len(ids) == 40, submitted
    seen: dict[str, list[Record]] = {}
    before: list[Record] = []
    killed = False
    group = f"python-client-{uuid.uuid4()}"
    started_ms = started.timestamp() * 1000 - 1000

    def handle(record: Record) -> None:
        nonlocal killed
        if record.timestamp_ms is not None and record.timestamp_ms < started_ms:
            before.append(record)  # from_time reads from the first record at or after it
        if record.completion is not None and record.task_id in ids:
            seen.setdefault(record.completion["task_id"], []).append(record)
        if not killed and len(seen) >= 5:
            os.kill(pids[0], signal.SIGKILL)
            killed = True

    with completions(BROKERS, group, from_time=started, dlq_topic=None) as consumer:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(seen) < len(ids):
            consumer.run(handle, max_records=1, idle_timeout=5)
        consumer.run(handle, idle_timeout=5)  # anything duplicated would come by now
    assert killed and len(seen) >= 5
    assert not before, f"{len(before)} records from before from_time"
    state = Path(f"/proc/{pids[0]}/status")
    assert not state.exists() or "State:\tZ" in state.read_text(), "the worker is dead"
    assert set(seen) == ids, f"{len(ids - set(seen))} never completed"
    twice = {k: [(r.partition, r.offset) for r in v] for k, v in seen.items() if len(v) > 1}
    assert not twice, f"seen twice: {twice}"
    assert {r[0].completion["status"] for r in seen.values() if r[0].completion} == {"succeeded"}
    # The group committed past everything it handled: a new reader of the group sees nothing old.
    with completions(BROKERS, group, dlq_topic=None) as again:
        repeated: list[Record] = []
        again.run(lambda r: repeated.append(r) if r.task_id in ids else None, idle_timeout=8)
    assert not repeated, [r.task_id for r in repeated]
