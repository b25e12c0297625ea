"""The engine on its own thread, bridged to asyncio.

The step thread is the only writer of engine state. Requests, aborts and switches (speculation on
or off) reach it through a queue; each step's deltas go back with ONE `call_soon_threadsafe` per event loop (not one per token), or
fewer where the streams let their deltas wait (`max_delay_s`), and `stats()` returns the snapshot
taken after the last step. On a GPU they go once the next step is queued on the device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.engine.api import process_settings
from app.engine.api.engine_client import TOOLS_IN_PROMPT, Prompt
from app.engine.core.llm_engine import LLMEngine
from app.engine.core.sequence import Sequence
from app.engine.types.errors import EngineDeadError, RequestError
from app.engine.types.fim import FimTokens
from app.engine.types.outputs import EngineStats, StreamDelta
from app.engine.types.progress import ProgressFn
from app.engine.types.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # requests and aborts wake the loop at once; this only paces the idle rate decay
# Readers poll the snapshot a few times a second (the panels, /metrics); taking one every step
# (a pass over every live request's block tables) cost the step thread time for nobody.
_STATS_PERIOD_S = 0.1


class AsyncEngine:
    """Implements `EngineClient` in-process. Settings are `LLMEngine`'s keyword arguments."""

    model_name: str
    max_model_len: int
    device: str
    dtype: str
    backend: str
    chat_template: bool  # only a GGUF that carries `tokenizer.chat_template` (not a shipped fallback)
    fim_tokens: FimTokens | None
    is_remote = False
    stats_source = ""  # the engine's own figures: nothing to qualify them with

    def __init__(
        self, model: str | None = None, device: str = "auto", dtype: str = "auto",
        progress: ProgressFn | None = None, **engine_kwargs: Any,
    ) -> None:
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Inbox, float]] = {}
        self._held: dict[asyncio.AbstractEventLoop, _Held] = {}  # deltas waiting for their loop's hand-off
        self._dead: str | None = None  # why the step thread died, once it has
        self._step_s = 0.0  # how long the last step took: held deltas go out when the next would be late
        self._pending: list = []  # deltas (and failed adds) not yet handed to `_publish`
        # On a GPU a step's deltas go out once the next step is queued on the device: the event
        # loops' work for them (the SSE chunks, the UI) then runs while the device computes instead
        # of taking the GIL from the step thread between its launches. Set once the device is known.
        self._publish_at_launch = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        # The model loads on the step thread itself: torch's OpenMP pool belongs to the thread that
        # first computes, and a step thread that inherits another thread's pool ran far slower.
        self._thread = threading.Thread(
            target=self._main, args=(model, device, dtype, progress, engine_kwargs), name="localbatch-engine", daemon=True
        )
        # The short GIL switch interval and the frozen model, held until close().
        self._settings = process_settings.hold()
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._settings.release()
            raise self._load_error
        plan = self.engine.plan
        self.tokenizer = plan.tokenizer
        # Random-weights engines have no tokenizer; a fallback template does not make a chat model.
        self.chat_template = self.tokenizer is not None and self.tokenizer.chat_template_name == "gguf"
        self.fim_tokens = self.tokenizer.fim_tokens if self.tokenizer is not None else None
        self.model_name = plan.model_name
        self.max_model_len = plan.max_model_len
        self.device = str(plan.setup.device)
        self.dtype = str(plan.setup.dtype).removeprefix("torch.")
        self.backend = self.engine.worker.backend

    # ---- EngineClient -------------------------------------------------------------------------
    async def stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *, max_delay_s: float = 0.0,
        tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto",
    ) -> AsyncIterator[StreamDelta]:
        if tools:
            raise RequestError(TOOLS_IN_PROMPT, param="tools")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(self._dead or "the engine has stopped; restart localbatch")
        # Tokenizing a long prompt and compiling a grammar take milliseconds to seconds: off the
        # event loop (the UI keeps drawing, the server keeps answering) and off the step thread.
        seq = await asyncio.to_thread(
            self.engine.make_sequence, prompt, params, request_id or f"req-{uuid.uuid4().hex[:12]}"
        )
        loop = asyncio.get_running_loop()
        inbox = _Inbox()
        self._streams[seq.request_id] = (loop, inbox, max_delay_s)
        self._send("add", seq)
        finished = False
        error: BaseException | None = None
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                # Deltas that arrived together go out as one: each one costs the consumer's loop
                # its per-delta work (an SSE event, a UI update).
                while item.finish_reason is None and inbox.items:
                    later = inbox.items.popleft()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = item.merged(later)
                finished = item.finish_reason is not None
                yield item
                if error is not None:
                    raise error
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self._stats

    def set_speculation(self, enabled: bool) -> bool:
        if self.engine.speculator is None:  # fixed at load
            return False
        self._send("speculation", enabled)  # the step thread switches it before its next step
        return True

    async def clear_kv_disk_cache(self) -> str:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(self._dead or "the engine has stopped; restart localbatch")
        done: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._send("clear_kv_disk_cache", done)  # the step thread owns the tier
        return await asyncio.wrap_future(done)

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
        return self.engine.inputs.require_tokenizer().encode(text, add_bos=add_bos, parse_special=parse_special)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.inputs.require_tokenizer().decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.engine.inputs.require_tokenizer().apply_chat_template(messages, add_generation_prompt, tools)

    async def aclose(self) -> None:
        # The join takes up to a step; off the loop, so the UI keeps drawing meanwhile.
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`aclose` for callers without an event loop (`with AsyncEngine(...)`, scripts)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._settings.release()

    # ---- the step thread ----------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _main(self, model: str | None, device: str, dtype: str, progress: ProgressFn | None, kwargs: dict) -> None:
        try:
            self.engine = LLMEngine(model, device=device, dtype=dtype, progress=progress, **kwargs)
            self._publish_at_launch = self.engine.plan.setup.device.type == "cuda"
            if self.engine.thread_tuner is not None:  # this thread is the engine's alone
                self.engine.thread_tuner.place_team()
            self._stats, self._stats_at = self.engine.stats(), time.monotonic()
            # The model, its tokenizer tables and the KV pool are millions of long-lived objects:
            # a full collection walked them all, holding the GIL, whenever the app's rendering
            # churned enough garbage (~25% of the UI thread's samples while streaming).
            self._settings.freeze()
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self._load_error = e
            return
        finally:
            self._loaded.set()
        self._run()

    def _run(self) -> None:
        try:
            self._loop()
            self._flush()
            self.engine.close()
        except Exception as e:  # noqa: BLE001 - a bug in the loop: fail every stream, not hang them
            log.exception("engine loop died")
            self._dead = f"the engine stopped after an internal error ({type(e).__name__}: {e}); restart localbatch"
            dead = EngineDeadError(self._dead)
            for loop, inbox, _ in list(self._streams.values()):
                try:
                    loop.call_soon_threadsafe(inbox.put_nowait, dead)
                except RuntimeError:
                    pass

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            drained = self._drain_inbox()
            busy = engine.has_unfinished()
            deltas: list = []
            if busy:
                started = time.monotonic()
                deltas = engine.step(on_launched=self._flush if self._publish_at_launch else None)
                self._step_s = time.monotonic() - started
            else:
                self._wake.wait(self._idle_wait_s())
                self._wake.clear()
            if self._publish_at_launch and engine.has_unfinished():
                self._flush()  # what no launch sent: the step ran no model
                self._pending = deltas  # sent once the next step is launched
            else:
                self._pending += deltas
                self._flush()
            # Idle, the snapshot only changes while the recent rates decay to zero; busy, it is
            # retaken every _STATS_PERIOD_S, and at once when the last request ends.
            if busy or drained or engine.metrics.window:
                now = time.monotonic()
                if now - self._stats_at >= _STATS_PERIOD_S or not engine.has_unfinished():
                    self._stats, self._stats_at = engine.stats(), now

    def _drain_inbox(self) -> int:
        """Apply what the callers sent (requests, aborts, switches); their deltas and failed adds
        join `_pending`. Returns how many items there were."""
        count = 0
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            if kind == "add":
                self._pending += self._add(payload)
            elif kind == "abort":
                if (delta := self.engine.abort(payload)) is not None:
                    self._pending.append(delta)
            elif kind == "clear_kv_disk_cache":
                try:
                    payload.set_result(self.engine.clear_kv_disk_cache())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    payload.set_exception(e)
            elif kind == "speculation":
                self.engine.set_speculation(payload)
                self._stats_at = float("-inf")  # shown in the next snapshot, taken below

    def _add(self, seq: Sequence) -> list:
        try:
            self.engine.add_sequence(seq)
        except Exception as e:  # noqa: BLE001 - handed to the caller's stream
            return [(seq.request_id, e)]
        return []

    def _flush(self) -> None:
        items, self._pending = self._pending, []
        self._publish(items)

    def _publish(self, items: list) -> None:
        """Group the deltas per event loop: one thread-safe call per loop each step, or, while
        every stream with something held allows it (`max_delay_s`), once the oldest has waited
        that long (or now, when the next step would end past that). Each wake-up of the loop
        costs its thread the GIL, which the step thread needs between torch ops: the TUI paints
        5 times a second and need not be woken at every step."""
        if not items and not self._held:
            return
        now = time.monotonic()
        for item in items:
            request_id, payload = (item if isinstance(item, tuple) else (item.request_id, item))
            target = self._streams.get(request_id)
            if target is None:
                continue
            loop, inbox, max_delay_s = target
            held = self._held.setdefault(loop, _Held())
            held.batch.append((inbox, payload))
            held.due = min(held.due, now if _urgent(payload) else now + max_delay_s)
        for loop, held in list(self._held.items()):
            if now + self._step_s < held.due:  # else the next step would end past the due time
                continue
            del self._held[loop]
            try:
                loop.call_soon_threadsafe(_deliver, held.batch)
            except RuntimeError:  # the caller's loop has closed
                pass

    def _idle_wait_s(self) -> float:
        """Idle, the loop still wakes for held deltas when they fall due."""
        if not self._held:
            return _IDLE_WAIT_S
        return min(_IDLE_WAIT_S, max(min(h.due for h in self._held.values()) - time.monotonic(), 0.0))

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Inbox:
    """One stream's deltas on its event loop: the part of `asyncio.Queue` a stream uses, without its
    per-item bookkeeping (getters, putters, task counts), which every token of every stream paid."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()


@dataclass
class _Held:
    batch: list[tuple[_Inbox, Any]] = field(default_factory=list)
    due: float = float("inf")


def _urgent(payload: Any) -> bool:
    """Errors, a stream's last delta and its first token never wait: they end a stream or set
    its time to first token."""
    if not isinstance(payload, StreamDelta):
        return True
    return payload.finish_reason is not None or payload.num_output_tokens <= len(payload.token_ids)


def _deliver(batch: list[tuple[_Inbox, Any]]) -> None:
    for inbox, payload in batch:
        inbox.put_nowait(payload)
