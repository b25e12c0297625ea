"""One HTTP request's engine requests: n choices (x prompts) submitted together so the engine batches
them, their deltas merged in arrival order, aborted together when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.types.outputs import StreamDelta, TopLogprobs
from app.engine.types.sampling_params import SamplingParams
from app.server.prometheus import ServerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass
class Job:
    """One engine request: a choice of one prompt."""

    prompt: Prompt
    params: SamplingParams
    prompt_index: int = 0


@dataclass
class Choice:
    """Everything one engine request has produced so far."""

    index: int
    request_id: str
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        return self.finish_reason in ("error", "abort")

    def add(self, delta: StreamDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = max(self.num_output_tokens, delta.num_output_tokens, len(self.token_ids))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.error = delta.error


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI usage: each prompt counted once, however many choices it has."""
    prompt_tokens = {c.prompt_index: c.num_prompt_tokens for c in choices}
    completion = sum(c.num_output_tokens for c in choices)
    prompt = sum(prompt_tokens.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class MultiStream:
    """Runs `jobs` as concurrent engine requests `{base_id}-{i}`.

    `start()` submits them all and waits for each one's first delta, so that errors the engine
    raises up front (bad request, queue full) surface before any HTTP response begins.
    `events()` then yields `(choice, delta)` as deltas arrive; `close()` aborts what is unfinished."""

    def __init__(self, engine: EngineClient, jobs: list[Job], base_id: str, metrics: ServerMetrics,
                 arrival: float | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.choices = [Choice(i, f"{base_id}-{i}", job.prompt_index) for i, job in enumerate(jobs)]
        self._jobs = jobs
        self._queue: asyncio.Queue[tuple[int, StreamDelta | Exception, float]] = asyncio.Queue()
        self._primed: deque[tuple[int, StreamDelta | Exception, float]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._direct: AsyncIterator[StreamDelta] | None = None  # the one choice's engine stream, when n = 1
        self._closed = False

    async def start(self) -> None:
        """Raises what the engine raised for the first failing choice (after aborting the others)."""
        try:
            if len(self._jobs) == 1:
                await self._start_direct()
                return
            for choice, job in zip(self.choices, self._jobs, strict=True):
                iterator = self.engine.stream(job.prompt, job.params, choice.request_id)
                self._tasks.append(asyncio.create_task(self._pump(choice.index, iterator)))
            waiting = {c.index for c in self.choices}
            while waiting:
                item = await self._queue.get()
                self._primed.append(item)
                if isinstance(item[1], Exception):
                    raise item[1]
                waiting.discard(item[0])
        except BaseException:
            self.close()
            raise

    async def _start_direct(self) -> None:
        """One choice (nearly every request) reads the engine's stream itself: no pump task, no
        second queue, one task wake-up per delta fewer on the event loop."""
        job, choice = self._jobs[0], self.choices[0]
        self._direct = self.engine.stream(job.prompt, job.params, choice.request_id)
        item = await self._next_direct()
        self._primed.append(item)
        if isinstance(item[1], Exception):
            raise item[1]

    async def _next_direct(self) -> tuple[int, StreamDelta | Exception, float]:
        try:
            item: StreamDelta | Exception = await anext(self._direct)
        except StopAsyncIteration:
            item = RuntimeError("the engine's stream ended without a finish reason")
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            item = exc
        return 0, item, time.perf_counter()

    async def _pump(self, index: int, iterator: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in iterator:
                self._queue.put_nowait((index, delta, time.perf_counter()))
                if delta.finish_reason is not None:
                    return
            missing = RuntimeError("the engine's stream ended without a finish reason")
            self._queue.put_nowait((index, missing, time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            self._queue.put_nowait((index, exc, time.perf_counter()))

    async def events(self) -> AsyncIterator[tuple[Choice, StreamDelta]]:
        while not all(c.finished for c in self.choices):
            if self._primed:
                index, item, arrived = self._primed.popleft()
            elif self._direct is not None:
                index, item, arrived = await self._next_direct()
            else:
                index, item, arrived = await self._queue.get()
            choice = self.choices[index]
            if choice.finished:
                continue
            delta = item if isinstance(item, StreamDelta) else self._as_error(choice, item)
            self._observe(choice, delta, arrived)
            choice.add(delta)
            yield choice, delta

    async def collect(self) -> list[Choice]:
        async for _ in self.events():
            pass
        return self.choices

    def close(self) -> None:
        """Abort every unfinished engine request; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for choice in self.choices:
            if not choice.finished:
                self.engine.abort(choice.request_id)
        for task in self._tasks:
            task.cancel()
        if self._direct is not None:
            self._tasks.append(asyncio.ensure_future(_close_quietly(self._direct)))

    @staticmethod
    def _as_error(choice: Choice, exc: Exception) -> StreamDelta:
        log.error("engine request %s failed: %s: %s", choice.request_id, type(exc).__name__, exc)
        return StreamDelta(choice.request_id, "", [], finish_reason="error", error=f"{type(exc).__name__}: {exc}",
                           num_prompt_tokens=choice.num_prompt_tokens, num_output_tokens=choice.num_output_tokens)

    def _observe(self, choice: Choice, delta: StreamDelta, now: float) -> None:
        if delta.token_ids:
            if choice.last_token_time is None:
                choice.first_token_time = now
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - choice.last_token_time) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.metrics.itl.observe(gap)
            choice.last_token_time = now
        if delta.finish_reason is not None:
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.observe_finished(delta.finish_reason)


async def _close_quietly(stream: AsyncIterator[StreamDelta]) -> None:
    """Run the engine stream's cleanup now rather than at garbage collection; a stream still
    being read (its reader is being cancelled) is closed by that cancellation instead."""
    with contextlib.suppress(RuntimeError):
        await stream.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (uvicorn does not cancel a handler
    whose client went away, and an abandoned request would hold KV blocks until it finished)."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher: asyncio.Future[None] = asyncio.ensure_future(_wait_disconnect(request))
    racers: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone("client disconnected")
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    message: dict[str, Any] = {}
    while message.get("type") != "http.disconnect":
        message = dict(await request.receive())
