"""One reply of a chat: its request, its client-side timing, the engine's figures for it, and its
row in the store, committed as it grows (`COMMIT_EVERY_S`: what a crash can lose of it).

The deltas go to a `ReplySink` (the view's buffer, `reply_stream.ReplyWriter`): per delta this
does only what it must (time it, hand the text over, and once a second a commit); painting is the
view's, on its frame clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from app.engine.api.engine_client import EngineClient
from app.engine.api.tool_use import CallStart, Text, ToolCallParser
from app.engine.types.outputs import StreamDelta
from app.engine.types.timing import ReplyClock
from app.tools.guidance import cut_call_cause
from app.ui.format import first_line
from app.ui.store import STREAMING, ChatStore, MessageRecord

COMMIT_EVERY_S = 1.0


class ReplySink(Protocol):
    """Where a reply's text goes as it streams; `text` is all of it so far. `calling(name)`: the
    model has begun a call to the tool `name` (its JSON is not text: the view says what it does)."""

    @property
    def text(self) -> str: ...

    def write(self, text: str) -> None: ...

    def calling(self, name: str) -> None: ...


class ReplyMetrics(ReplyClock):
    """Client-side timing of one reply (what the panels show when the engine has no figure)."""

    def observe(self, delta: StreamDelta, now: float) -> None:
        if not delta.token_ids and not delta.text:
            return
        self.tick(now)
        self.num_tokens = delta.num_output_tokens or self.num_tokens + max(len(delta.token_ids), 1)

    @property
    def ttft_s(self) -> float | None:
        return self.timing().ttft_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.timing().tokens_per_s


@dataclass(frozen=True)
class ReplyEnd:
    """How a reply ended: its finish reason, an error's one line, and the tool calls it made
    (OpenAI's shape; parsed from the reply when its request offered tools)."""

    finish_reason: str
    error: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # The token limit ended the reply inside its last call, or (no calls) inside a call block
    # before its name: why (`cut_call_cause`).
    cut_call: str | None = None


class Reply:
    """One reply while it is generated and after: the panels read its figures until the next."""

    def __init__(self, request_id: str, store: ChatStore, chat_id: int, model: str) -> None:
        self.request_id = request_id
        self.metrics = ReplyMetrics(started=time.monotonic())
        self.running = True  # until the view has shown its end
        self.stop_requested = False  # also covers a stop that lands before the stream has begun
        self.streaming = False  # inside the stream loop, where a stop may cancel the task
        # The engine's (tok/s, TTFT) for this reply, last seen while it ran: the panel keeps
        # showing the engine's measure after the reply ends instead of switching to the client's.
        self.engine_figures: tuple[float | None, float | None] | None = None
        # (cached, prompt, of the cached read from disk) tokens of this reply's prompt, when the
        # prefix cache served some (a forked chat's first reply, a chat reopened): shown under it.
        self.cache_hit: tuple[int, int, int] | None = None
        self.finish_reason: str | None = None
        self._store, self._chat_id, self._model = store, chat_id, model
        self._row: MessageRecord | None = None  # its row once committed
        self._committed_at = time.monotonic()

    async def stream(self, engine: EngineClient, request: Callable[[], tuple[Any, ...]],
                     sink: ReplySink, max_delay_s: float = 0.0) -> ReplyEnd:
        """Ask `engine` for the reply to `request()` (prompt, params, and a `ToolCallParser` when
        tools are offered, then keyword arguments of `engine.stream`: a remote engine's tools) and
        pass its deltas to `sink`, committing the text once a second, until the reply ends, fails
        (a bad request included) or is stopped (a cancel of the task too: it ends here). With a
        parser the sink gets the reply's text less its calls, and the calls end up in
        `ReplyEnd.tool_calls`."""
        metrics = self.metrics
        self.streaming = True
        deltas = None
        parser: ToolCallParser | None = None
        try:
            if self.stop_requested:
                return ReplyEnd("abort")
            prompt, params, *rest = request()
            parser = rest[0] if rest else None
            extra = rest[1] if len(rest) > 1 else {}  # a remote engine's `tools`
            deltas = engine.stream(prompt, params, self.request_id, max_delay_s=max_delay_s, **extra)
            async for delta in deltas:
                if self.stop_requested:
                    return _with_calls(ReplyEnd("abort"), parser, sink)
                now = time.monotonic()
                metrics.observe(delta, now)
                if parser is None:
                    sink.write(delta.text)
                elif delta.text:
                    _write_text(parser.feed(delta.text), sink)
                if now - self._committed_at >= COMMIT_EVERY_S and sink.text:
                    self.commit(sink.text, STREAMING)
                    self._committed_at = now
                if delta.finish_reason:
                    return _with_calls(ReplyEnd(delta.finish_reason, delta.error), parser, sink, params.max_tokens)
            return _with_calls(ReplyEnd("stop"), parser, sink)
        except asyncio.CancelledError:
            # A stop cancelled us on purpose: the reply ends here and is still committed.
            asyncio.current_task().uncancel()
            return ReplyEnd("abort")
        except Exception as e:  # noqa: BLE001 — any engine failure ends this reply, not the app
            return ReplyEnd("error", first_line(e))
        finally:
            self.streaming = False
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    def commit(self, text: str, finish: str, tool_calls: list[dict[str, Any]] | None = None) -> MessageRecord:
        """The reply so far (`STREAMING`) or whole, in one write: inserted once, then updated."""
        metrics = self.metrics
        figures = {"finish_reason": finish, "num_tokens": metrics.num_tokens, "ttft_s": metrics.ttft_s,
                   "tokens_per_s": metrics.tokens_per_s}
        if self._row is None:
            self._row = self._store.add_message(self._chat_id, "assistant", text, model=self._model,
                                                tool_calls=tool_calls, **figures)
        else:
            self._row = self._store.update_reply(self._row, text, tool_calls=tool_calls, **figures)
        return self._row

    def discard(self) -> None:
        """An empty reply leaves no row (a partial one committed before it failed goes)."""
        if self._row is not None:
            self._store.delete_message(self._row.id)
            self._row = None


def _write_text(events: list[Any], sink: ReplySink) -> None:
    for event in events:
        if isinstance(event, Text):
            sink.write(event.text)
        elif isinstance(event, CallStart):
            sink.calling(event.name)


def _with_calls(end: ReplyEnd, parser: ToolCallParser | None, sink: ReplySink,
                max_tokens: int | None = None) -> ReplyEnd:
    """`end` with the calls the parser found (what it held back written out first); a reply
    that failed or was stopped runs none of them. One that hit its token limit (`max_tokens`)
    inside a call says so (`cut_call`)."""
    if parser is None:
        return end
    _write_text(parser.finish(), sink)
    cut_last = parser.unclosed_call or not parser.calls  # else an unnamed block after whole calls: they run
    cut = cut_call_cause(max_tokens) if end.finish_reason == "length" and parser.unclosed and cut_last else None
    if not parser.calls or end.error or end.finish_reason in ("abort", "error"):
        return replace(end, cut_call=cut)
    return ReplyEnd(end.finish_reason, end.error, [call.openai() for call in parser.calls], cut)
