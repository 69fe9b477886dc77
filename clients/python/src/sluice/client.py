"""The synchronous client: `Client` and its `Task`. `sluice.aio` is its asynchronous twin."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import closing
from typing import Any, cast

import httpx

from . import _protocol as p
from .errors import APIError, NotFound, SluiceError
from .types import ModelInfo, Priority, TaskPage, TaskState, TaskStatus, WebhookSpec

class Client:
    """A producer's HTTP API.

    `url` and `api_key` default to the `SLUICE_URL` and `SLUICE_API_KEY` environment variables.
    Requests answered 429/502/503/504, or not answered, are retried as `retries` says, honouring
    `Retry-After`; submissions are safe to retry because each carries an idempotency key.
    Thread-safe; use it as a context manager or `close()` it.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 30.0,
        retries: p.Retries | None = None,
        user: str | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self._settings = p.settings(url, api_key, timeout, retries, user)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=self._settings.timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the HTTP client this client made (not one passed in)."""
        if self._owns_http:
            self._http.close()

    # -- requests -------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str | int] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        attempts = p.Attempts(self._settings.retries, f"{method} {path}")
        while True:
            try:
                response = self._http.request(
                    method,
                    self._settings.url + path,
                    json=json,
                    params=params,
                    headers={**self._settings.headers, **(headers or {})},
                )
            except httpx.TransportError as e:
                time.sleep(attempts.after_transport_error(e))
                continue
            delay = attempts.after_answer(response, p.api_error)
            if delay is None:
                return response
            time.sleep(delay)

    # -- the API --------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        prompt: str | None = None,
        *,
        idempotency_key: str | None = None,
        webhook: str | WebhookSpec | None = None,
        deadline: str | None = None,
        ttl_seconds: int | None = None,
        priority: Priority | None = None,
        user: str | None = None,
        **params: Any,
    ) -> Task:
        """Queues a task: `params` are the request's other fields (`width`, `steps`, `seed`,
        `num_images`, `params` for model-specific values, …). Returns once the broker holds it."""
        body = p.submission(
            model, prompt, params, webhook=webhook, deadline=deadline, ttl_seconds=ttl_seconds, priority=priority
        )
        headers = p.submission_headers(idempotency_key, user or self._settings.user)
        reply = p.json_body(self._request("POST", "/v1/tasks", json=body, headers=headers))
        return Task(self, str(reply["task_id"]), submitted=True)

    def submit_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 8,
        key_prefix: str | None = None,
        on_progress: Callable[[p.BatchProgress], None] | None = None,
    ) -> list[Task | SluiceError]:
        """Submits many requests, `concurrency` at a time: each a mapping of the request's
        fields (`model`, `prompt`, …, and optionally its own `idempotency_key`). With
        `key_prefix`, request `i` has the key `<key_prefix>-<i>`, so running the same batch again
        after a crash submits nothing twice. Returns, in order, each request's `Task` or the
        error that refused it (an `APIError`, or `ConnectionFailed`); `on_progress` is called
        after each answer, as answers come."""
        items = list(requests)
        done = failed = 0

        def one(index: int) -> Task | SluiceError:
            request = items[index]
            model, prompt, fields = p.batch_fields(request)
            try:
                return self.submit(model, prompt, idempotency_key=p.batch_key(key_prefix, index, request), **fields)
            except SluiceError as e:
                return e

        results: dict[int, Task | SluiceError] = {}
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = {pool.submit(one, i): i for i in range(len(items))}
            for future in as_completed(futures):
                result = results[futures[future]] = future.result()
                done += 1
                failed += isinstance(result, SluiceError)
                if on_progress is not None:
                    on_progress(p.BatchProgress(done, len(items), failed))
        return [results[i] for i in range(len(items))]

    def task(self, task_id: str) -> Task:
        """A handle on a task submitted earlier."""
        return Task(self, task_id)

    def get(self, task_id: str) -> TaskStatus:
        """`GET /v1/tasks/{id}`: the task as the status view holds it."""
        return cast(TaskStatus, p.json_body(self._request("GET", f"/v1/tasks/{task_id}")))

    def tasks(self, *, status: TaskState | None = None, since: str | None = None, page_size: int = 100) -> Iterator[TaskStatus]:
        """The caller's tasks, newest first, following the pages."""
        params: dict[str, str | int] = {"limit": page_size}
        if status:
            params["status"] = status
        if since:
            params["since"] = since
        while True:
            page = cast(TaskPage, p.json_body(self._request("GET", "/v1/tasks", params=params)))
            yield from page["tasks"]
            cursor = page.get("next_cursor")
            if not cursor:
                return
            params["cursor"] = cursor

    def models(self) -> list[ModelInfo]:
        """`GET /v1/models`: every served model, its bounds and defaults."""
        return cast(list[ModelInfo], p.json_body(self._request("GET", "/v1/models"))["models"])

    def cancel(self, task_id: str) -> None:
        """Cancels a task (a queued task never runs; a running diffusion task stops between
        steps). Raises `AlreadyFinished` once it finished."""
        self._request("POST", f"/v1/tasks/{task_id}/cancel")

    def download(self, url: str) -> bytes:
        """The bytes behind a presigned output URL (no API key is sent there)."""
        attempts = p.Attempts(self._settings.retries, "downloading an output")
        while True:
            try:
                response = self._http.get(url, headers={"User-Agent": p.USER_AGENT})
            except httpx.TransportError as e:
                time.sleep(attempts.after_transport_error(e))
                continue
            delay = attempts.after_answer(response, p.download_error)
            if delay is None:
                return response.content
            time.sleep(delay)

    def _events(self, task_id: str, deadline: float | None, last_event_id: str | None) -> Generator[p.Event, None, None]:
        """One connection to the task's event stream, from `last_event_id`."""
        headers = {**self._settings.headers, "Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        read = 30.0 if deadline is None else max(0.1, min(30.0, deadline - time.monotonic()))
        timeout = httpx.Timeout(self._settings.timeout.connect or 10.0, read=read)
        with self._http.stream(
            "GET", f"{self._settings.url}/v1/tasks/{task_id}/events", headers=headers, timeout=timeout
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise p.api_error(response)
            decoder = p.SSEDecoder()
            for line in response.iter_lines():
                if deadline is not None and time.monotonic() >= deadline:
                    return  # heartbeats keep a stream alive: the caller's deadline ends it
                sse = decoder.line(line)
                if sse is not None:
                    event = p.event_of(*sse)
                    if event is not None:
                        yield event


class Task:
    """A submitted task: follow it, cancel it, fetch its images."""

    def __init__(self, client: Client, task_id: str, *, submitted: bool = False) -> None:
        self._client = client
        self.id = task_id
        # Just accepted: the status view may not know it for a moment.
        self._unknown_until = time.monotonic() + p.UNKNOWN_GRACE if submitted else 0.0

    def __repr__(self) -> str:
        return f"Task({self.id!r})"

    def status(self) -> TaskStatus:
        """The task now (`GET /v1/tasks/{id}`)."""
        return self._client.get(self.id)

    def cancel(self) -> None:
        """See `Client.cancel`."""
        self._client.cancel(self.id)

    def events(self, timeout: float | None = None) -> Generator[p.Event, None, None]:
        """The task's events as they happen, the current state first, until its end (then the
        iterator stops). Reconnects with `Last-Event-ID` when the stream is cut; right after a
        submission, waits until the status view knows the task. Raises `WaitTimeout` after
        `timeout` seconds (checked at each event and heartbeat, every 15 s at most), and the
        last error once streams keep failing."""
        return self._stream(self._following(timeout))

    def _following(self, timeout: float | None) -> p.Following:
        return p.Following(self.id, timeout, self._client._settings.retries, self._unknown_until)

    def _stream(self, follow: p.Following) -> Generator[p.Event, None, None]:
        while True:
            follow.connecting()
            try:
                with closing(self._client._events(self.id, follow.deadline, follow.last_id)) as stream:
                    for event in stream:
                        follow.seen(event.task, event.id)
                        yield event
                        if event.terminal:
                            return
                delay = follow.after_stream()
            except (httpx.TransportError, APIError) as e:
                delay = follow.after_error(e)
            time.sleep(delay)

    def wait(self, timeout: float | None = None, *, poll_interval: float = 1.0) -> TaskStatus:
        """Waits until the task ends (succeeded, failed, cancelled or expired) and returns its
        final state. Follows the event stream, and falls back to polling every `poll_interval`
        seconds where streams are refused (too many open) or keep failing. Raises `WaitTimeout`."""
        follow = self._following(timeout)
        try:
            with closing(self._stream(follow)) as events:
                for event in events:
                    if event.terminal:
                        return event.task
        except p.STREAM_FALLBACK:
            pass
        while True:
            try:
                status = self.status()
                follow.seen(status)
                if p.is_terminal(status):
                    return status
            except NotFound as e:
                follow.unknown(e)
            time.sleep(follow.before_poll(poll_interval))

    def images(self, timeout: float | None = None) -> list[p.Image]:
        """Waits for the task, then downloads its images through their presigned URLs, each
        checked against its announced size and SHA-256. Raises `TaskNotSucceeded` if it did not
        succeed."""
        status = self.wait(timeout)
        return [p.image_of(o, self._client.download(o["url"])) for o in p.outputs_to_fetch(status)]
