"""The engine as its clients (HTTP server, TUI) see it. `AsyncEngine` implements it in-process,
`app.clients.remote.RemoteEngine` over HTTP, `tests.support.fake_engine.FakeEngine` in tests.

Clients use only what is declared here, so every implementation declares every member. Kept
torch-free: the TUI and the server name it before (or without) loading the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from app.engine.types.fim import FimTokens
from app.engine.types.outputs import EngineStats, StreamDelta
from app.engine.types.prompt import Prompt
from app.engine.types.sampling_params import SamplingParams


# What an in-process engine says to `stream(..., tools=...)`.
TOOLS_IN_PROMPT = "an in-process engine takes tools in the prompt (tool_use.tool_request), not as stream(tools=...)"


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    max_model_len: int  # context length in tokens; 0 when a remote server does not say
    device: str  # where it runs, for people: "cuda:0", "cpu", "remote host:8000"
    dtype: str  # compute dtype without the "torch." prefix; "" when unknown (a remote server)
    # Which kernels compute, for people: "C kernels (AVX2)", "torch kernels: <why not the C ones>",
    # "Triton kernels"; "" when unknown (a remote server).
    backend: str
    # True when the engine runs elsewhere: the TUI offers no embedded endpoint then (it would only
    # proxy that server), and one left unclosed after a crash holds only sockets that die with us.
    is_remote: bool
    # True when the model has its own chat template (the GGUF's `tokenizer.chat_template`; a remote
    # server serves chat completions, so True). False for a base model: the TUI then sends a plain-
    # text prompt the model continues (see `app.ui.session.history.completion_prompt`), no template tokens.
    chat_template: bool
    # The model's fill-in-the-middle tokens (code models: /infill, `suffix` on /v1/completions);
    # None when it has none, or when a remote server does not say.
    fim_tokens: FimTokens | None

    @property
    def stats_source(self) -> str:
        """Where `stats()` figures come from, shown under the KV panel: "" for the engine's own
        figures, otherwise a short note (a remote server's /metrics, or client-side estimates)."""
        ...

    def stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *, max_delay_s: float = 0.0,
        tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto",
    ) -> AsyncIterator[StreamDelta]:
        """Submit a request and iterate its deltas; the last one has `finish_reason` set.

        `max_delay_s`: deltas may wait up to this long and arrive together, for a consumer that
        does not need every step (the TUI paints a few times a second); the first token and the
        last delta never wait.

        `tools` (OpenAI tool entries, with chat messages) are for an engine whose server renders
        and constrains them itself (`is_remote`: they go in its `tools` field, `tool_choice` in
        its own: "auto" or "required"). An in-process
        engine refuses them: its tools go into the prompt and params through `tool_use.tool_request`.

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

    def set_speculation(self, enabled: bool) -> bool:
        """Turn speculative decoding on or off from the next step on; False (and nothing changes)
        when the engine was started without a `speculative_config`."""
        ...

    async def clear_kv_disk_cache(self) -> str:
        """Remove the KV disk tier's block files (the prefix cache in memory stays); returns one line
        for people: what went, or why nothing could (the tier is off, a remote server cannot)."""
        ...

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `parse_special=False` keeps special-token text (`<|im_start|>` in a
        user's file) as plain text, as llama.cpp tokenizes an infill's parts."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...

    async def aclose(self) -> None:
        """Stop the engine (or drop the connection) and release what it holds; call it from the
        event loop that streamed. Calling it again does nothing; streaming afterwards is an error."""
        ...
