"""POST /v1/chat/completions: `chat.completion` objects and `chat.completion.chunk` events."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.engine.core.outputs import StreamDelta, TopLogprobs
from app.server.logprobs import chat_logprobs
from app.server.openai_schema import ChatCompletionRequest
from app.server.serving import Endpoint, ServerState, handle_generation
from app.server.streams import Choice


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await handle_generation(request, body, _Chat)


class _Chat(Endpoint):
    """One conversation, templated by the engine; the reply is an assistant message."""

    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, body: ChatCompletionRequest) -> None:
        messages = body.engine_messages()
        # No max_tokens: the engine generates until the context (or the KV pool) is full.
        params = body.sampling_params(body.requested_max_tokens(), body.engine_logprobs())
        super().__init__(state, [messages], params)
        self.body = body

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        return [_entry(choice, {"role": "assistant", "content": ""})]

    def streamed(self, choice: Choice, delta: StreamDelta) -> list[dict[str, Any]]:
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or []) if delta.token_ids else None
        entries = []
        if delta.text or logprobs:
            entries.append(_entry(choice, {"content": delta.text}, logprobs=logprobs))
        # The finish reason comes alone, in a chunk with an empty delta, as OpenAI sends it.
        if delta.finish_reason is not None:
            entries.append(_entry(choice, {}, finish_reason=delta.finish_reason))
        return entries

    def whole(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs), "finish_reason": choice.finish_reason}

    def _logprobs(self, token_ids: list[int], dists: list[TopLogprobs]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.texts, token_ids, dists, self.body.top_logprobs or 0)


def _entry(choice: Choice, delta: dict[str, Any], finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
