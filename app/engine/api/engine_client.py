"""The engine as its clients (HTTP server, TUI) see it. `AsyncEngine` implements it in-process; the
TUI's remote backend implements it over HTTP; tests implement it with fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from app.engine.api.sampling_params import SamplingParams
from app.engine.core.outputs import EngineStats, StreamDelta

# A prompt: raw text (no chat template), token ids, or chat messages
# ([{"role": "system"|"user"|"assistant", "content": str}, ...]; the chat template is applied).
Prompt = str | list[int] | list[dict[str, Any]]


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    def stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Submit a request and iterate its deltas; the last one has `finish_reason` set.

        Raises `RequestError` (invalid request, prompt longer than the context: nothing was queued)
        or `QueueFullError` (backpressure) before the first delta. Breaking out of the iteration
        (or cancelling the task) aborts the request and frees its KV blocks."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids are ignored."""
        ...

    def stats(self) -> EngineStats:
        """A cheap immutable snapshot (the UI polls ~10x/s)."""
        ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...
