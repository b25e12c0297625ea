"""A deterministic fake `EngineClient` for the TUI tests: streams a reply word by word with a small
delay, can be paused to catch a reply mid-stream, and reports stats derived from what is live
(or a fixed snapshot, for screenshots)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.engine.api.errors import RequestError
from app.engine.api.sampling_params import SamplingParams
from app.engine.core.outputs import EngineStats, RequestStats, StreamDelta


@dataclass
class _Live:
    prompt_tokens: int
    output_tokens: int = 0
    started: float = 0.0
    first_token_at: float | None = None


class FakeEngine:
    model_name = "fake-model-q4"
    max_model_len = 4096
    device = "cpu"
    dtype = "bfloat16"

    def __init__(
        self,
        *,
        token_delay: float = 0.002,
        num_blocks_total: int = 512,
        block_size: int = 16,
        kv_bytes_per_token: int = 18432,
        frozen_stats: EngineStats | None = None,
    ) -> None:
        self.token_delay = token_delay
        self.num_blocks_total = num_blocks_total
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.frozen_stats = frozen_stats
        self.paused = False  # while True, live streams hold before their next token
        self.hold_after: int | None = None  # streams hold once they have yielded this many tokens
        self.fail_next: Exception | None = None  # raised by the next stream before its first delta
        self.calls: list[tuple[Any, SamplingParams, str]] = []
        self.aborted: list[str] = []
        self.max_concurrent = 0
        self.closed = False
        self._live: dict[str, _Live] = {}
        self._aborting: set[str] = set()
        self._recent: list[float] = []

    @staticmethod
    def reply_words(prompt: Any) -> list[str]:
        """The deterministic reply: 'Reply to:' then the last user message's words."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            users = [m["content"] for m in prompt if m["role"] == "user"]
            text = users[-1] if users else ""
        else:
            text = str(prompt)
        return ["Reply", " to:"] + [f" {w}" for w in text.split()]

    async def stream(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        request_id = request_id or f"fake-{len(self.calls)}"
        self.calls.append((prompt, params, request_id))
        words = self.reply_words(prompt)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in prompt) if isinstance(prompt, list) else len(str(prompt).split())
        live = _Live(prompt_tokens=prompt_tokens, started=time.monotonic())
        self._live[request_id] = live
        self.max_concurrent = max(self.max_concurrent, len(self._live))
        try:
            for i, word in enumerate(words[: params.max_tokens]):
                await asyncio.sleep(self.token_delay)
                while self._holding(i) and request_id not in self._aborting:
                    await asyncio.sleep(0.005)
                if request_id in self._aborting:
                    yield StreamDelta(request_id, "", [], "abort", num_prompt_tokens=prompt_tokens, num_output_tokens=i)
                    return
                live.output_tokens = i + 1
                live.first_token_at = live.first_token_at or time.monotonic()
                self._recent.append(time.monotonic())
                yield StreamDelta(request_id, word, [1000 + i], None, num_prompt_tokens=prompt_tokens, num_output_tokens=i + 1)
            reason = "length" if len(words) > params.max_tokens else "stop"
            yield StreamDelta(request_id, "", [], reason, num_prompt_tokens=prompt_tokens, num_output_tokens=live.output_tokens)
        finally:
            self._live.pop(request_id, None)
            self._aborting.discard(request_id)

    def _holding(self, num_yielded: int) -> bool:
        return self.paused or (self.hold_after is not None and num_yielded >= self.hold_after)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self._live:
            self._aborting.add(request_id)

    def live_request_ids(self) -> list[str]:
        return list(self._live)

    def stats(self) -> EngineStats:
        if self.frozen_stats is not None:
            return self.frozen_stats
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < 1.0]
        requests = tuple(self._request_stats(rid, live, now) for rid, live in self._live.items())
        return EngineStats(
            num_running=len(requests),
            num_blocks_total=self.num_blocks_total,
            num_blocks_used=sum(r.num_blocks for r in requests),
            num_blocks_cached_free=4,
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            decode_tokens_per_s=float(len(self._recent)),
            last_batch_size=len(requests),
            last_num_tokens=len(requests),
            last_step_time_s=self.token_delay,
            num_steps=len(self.calls),
            requests=requests,
        )

    def _request_stats(self, request_id: str, live: _Live, now: float) -> RequestStats:
        tokens = live.prompt_tokens + live.output_tokens
        ttft = None if live.first_token_at is None else live.first_token_at - live.started
        return RequestStats(
            request_id, "decode" if live.output_tokens else "prefill", live.prompt_tokens, live.output_tokens,
            max(math.ceil(tokens / self.block_size), 1), 0, ttft, None, None,
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([1] if add_bos else []) + [len(w) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(str(t) for t in token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def close(self) -> None:
        self.closed = True
