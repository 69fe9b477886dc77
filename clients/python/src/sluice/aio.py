"""The asynchronous client: `AsyncClient` and its `AsyncTask`, the twins of `sluice.Client` and
`sluice.Task` with the same methods, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from contextlib import aclosing
from typing import Any, cast

import httpx

from . import _protocol as p
from .errors import APIError, NotFound, SluiceError
from .types import ModelInfo, Priority, TaskPage, TaskState, TaskStatus, WebhookSpec

class AsyncClient:
    """A producer's HTTP API, for asyncio. See `sluice.Client`."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 30.0,
        retries: p.Retries | None = None,
        user: str | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._settings = p.settings(url, api_key, timeout, retries, user)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=self._settings.timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the HTTP client this client made (not one passed in)."""
        if self._owns_http:
            await self._http.aclose()

    async def _request(
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
                response = await self._http.request(
                    method,
                    self._settings.url + path,
                    json=json,
                    params=params,
                    headers={**self._settings.headers, **(headers or {})},
                )
            except httpx.TransportError as e:
                await asyncio.sleep(attempts.after_transport_error(e))
                continue
            delay = attempts.after_answer(response, p.api_error)
            if delay is None:
                return response
            await asyncio.sleep(delay)

    async def submit(
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
    ) -> AsyncTask:
        """See `sluice.Client.submit`."""
        body = p.submission(
            model, prompt, params, webhook=webhook, deadline=deadline, ttl_seconds=ttl_seconds, priority=priority
        )
        headers = p.submission_headers(idempotency_key, user or self._settings.user)
        reply = p.json_body(await self._request("POST", "/v1/tasks", json=body, headers=headers))
        return AsyncTask(self, str(reply["task_id"]), submitted=True)

    async def submit_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 8,
        key_prefix: str | None = None,
        on_progress: Callable[[p.BatchProgress], None] | None = None,
    ) -> list[AsyncTask | SluiceError]:
        """See `sluice.Client.submit_many`."""
        items = list(requests)
        gate = asyncio.Semaphore(max(1, concurrency))
        counts = [0, 0]

        async def one(index: int) -> AsyncTask | SluiceError:
            request = items[index]
            model, prompt, fields = p.batch_fields(request)
            async with gate:
                try:
                    result: AsyncTask | SluiceError = await self.submit(
                        model, prompt, idempotency_key=p.batch_key(key_prefix, index, request), **fields
                    )
                except SluiceError as e:
                    result = e
            counts[0] += 1
            counts[1] += isinstance(result, SluiceError)
            if on_progress is not None:
                on_progress(p.BatchProgress(counts[0], len(items), counts[1]))
            return result

        return list(await asyncio.gather(*(one(i) for i in range(len(items)))))

    def task(self, task_id: str) -> AsyncTask:
        return AsyncTask(self, task_id)

    async def get(self, task_id: str) -> TaskStatus:
        return cast(TaskStatus, p.json_body(await self._request("GET", f"/v1/tasks/{task_id}")))

    async def tasks(
        self, *, status: TaskState | None = None, since: str | None = None, page_size: int = 100
    ) -> AsyncIterator[TaskStatus]:
        params: dict[str, str | int] = {"limit": page_size}
        if status:
            params["status"] = status
        if since:
            params["since"] = since
        while True:
            page = cast(TaskPage, p.json_body(await self._request("GET", "/v1/tasks", params=params)))
            for task in page["tasks"]:
                yield task
            cursor = page.get("next_cursor")
            if not cursor:
                return
            params["cursor"] = cursor

    async def models(self) -> list[ModelInfo]:
        return cast(list[ModelInfo], p.json_body(await self._request("GET", "/v1/models"))["models"])

    async def cancel(self, task_id: str) -> None:
        await self._request("POST", f"/v1/tasks/{task_id}/cancel")

    async def download(self, url: str) -> bytes:
        attempts = p.Attempts(self._settings.retries, "downloading an output")
        while True:
            try:
                response = await self._http.get(url, headers={"User-Agent": p.USER_AGENT})
            except httpx.TransportError as e:
                await asyncio.sleep(attempts.after_transport_error(e))
                continue
            delay = attempts.after_answer(response, p.download_error)
            if delay is None:
                return response.content
            await asyncio.sleep(delay)

    async def _events(self, task_id: str, deadline: float | None, last_event_id: str | None) -> AsyncGenerator[p.Event, None]:
        headers = {**self._settings.headers, "Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        read = 30.0 if deadline is None else max(0.1, min(30.0, deadline - time.monotonic()))
        timeout = httpx.Timeout(self._settings.timeout.connect or 10.0, read=read)
        async with self._http.stream(
            "GET", f"{self._settings.url}/v1/tasks/{task_id}/events", headers=headers, timeout=timeout
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                raise p.api_error(response)
            decoder = p.SSEDecoder()
            async for line in response.aiter_lines():
                if deadline is not None and time.monotonic() >= deadline:
                    return
                sse = decoder.line(line)
                if sse is not None:
                    event = p.event_of(*sse)
                    if event is not None:
                        yield event


class AsyncTask:
    """A submitted task, for asyncio. See `sluice.Task`."""

    def __init__(self, client: AsyncClient, task_id: str, *, submitted: bool = False) -> None:
        self._client = client
        self.id = task_id
        self._unknown_until = time.monotonic() + p.UNKNOWN_GRACE if submitted else 0.0

    def __repr__(self) -> str:
        return f"AsyncTask({self.id!r})"

    async def status(self) -> TaskStatus:
        return await self._client.get(self.id)

    async def cancel(self) -> None:
        await self._client.cancel(self.id)

    def events(self, timeout: float | None = None) -> AsyncGenerator[p.Event, None]:
        """See `sluice.Task.events`."""
        return self._stream(self._following(timeout))

    def _following(self, timeout: float | None) -> p.Following:
        return p.Following(self.id, timeout, self._client._settings.retries, self._unknown_until)

    async def _stream(self, follow: p.Following) -> AsyncGenerator[p.Event, None]:
        while True:
            follow.connecting()
            try:
                async with aclosing(self._client._events(self.id, follow.deadline, follow.last_id)) as stream:
                    async for event in stream:
                        follow.seen(event.task, event.id)
                        yield event
                        if event.terminal:
                            return
                delay = follow.after_stream()
            except (httpx.TransportError, APIError) as e:
                delay = follow.after_error(e)
            await asyncio.sleep(delay)

    async def wait(self, timeout: float | None = None, *, poll_interval: float = 1.0) -> TaskStatus:
        """See `sluice.Task.wait`."""
        follow = self._following(timeout)
        try:
            async with aclosing(self._stream(follow)) as events:
                async for event in events:
                    if event.terminal:
                        return event.task
        except p.STREAM_FALLBACK:
            pass
        while True:
            try:
                status = await self.status()
                follow.seen(status)
                if p.is_terminal(status):
                    return status
            except NotFound as e:
                follow.unknown(e)
            await asyncio.sleep(follow.before_poll(poll_interval))

    async def images(self, timeout: float | None = None) -> list[p.Image]:
        """See `sluice.Task.images`; the images are downloaded concurrently."""
        status = await self.wait(timeout)
        outputs = p.outputs_to_fetch(status)
        data = await asyncio.gather(*(self._client.download(o["url"]) for o in outputs))
        return [p.image_of(o, d) for o, d in zip(outputs, data)]
