"""POST /v1/chat/completions: `chat.completion` objects and `chat.completion.chunk` events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from app.server.http_errors import failed_request
from app.server.logprobs import TokenTexts, chat_logprobs
from app.server.openai_schema import ChatCompletionRequest
from app.server.serving import (
    SSE_DONE,
    EventStreamResponse,
    ResponseMeta,
    ServerState,
    client_closed,
    collect,
    fan_out,
    server_state,
    sse,
    start_streams,
)
from app.server.streams import Choice, MultiStream, usage


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    state = server_state(request)
    state.check_model(body.model)
    body.check_combinations()
    messages = body.engine_messages()
    # No max_tokens: the engine generates until the context (or the KV pool) is full.
    params = body.sampling_params(body.requested_max_tokens(), body.engine_logprobs())
    streams = await start_streams(request, state, fan_out([messages], params, body.n), "chatcmpl", arrival)
    if streams is None:
        return client_closed()
    meta = ResponseMeta.new("chatcmpl", state.model_name, body.include_usage)
    if body.stream:
        return EventStreamResponse(_events(streams, meta, state, body))
    if await collect(request, streams) is None:
        return client_closed()
    return JSONResponse(_response(streams.choices, meta, state, body))


def _response(choices: list[Choice], meta: ResponseMeta, state: ServerState,
              body: ChatCompletionRequest) -> dict[str, Any]:
    for choice in choices:
        if choice.failed:
            raise failed_request(choice.finish_reason, choice.error)
    texts = TokenTexts(state.engine)
    out = meta.header("chat.completion")
    out["choices"] = [{
        "index": c.index,
        "message": {"role": "assistant", "content": "".join(c.text)},
        "logprobs": chat_logprobs(texts, c.token_ids, c.logprobs, body.top_logprobs or 0) if body.logprobs else None,
        "finish_reason": c.finish_reason,
    } for c in choices]
    out["usage"] = usage(choices)
    return out


def _chunk(meta: ResponseMeta, index: int, delta: dict[str, Any], finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    out = meta.header("chat.completion.chunk")
    out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    if meta.include_usage:
        out["usage"] = None  # OpenAI sends an explicit null on every chunk but the last
    return out


async def _events(streams: MultiStream, meta: ResponseMeta, state: ServerState,
                  body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    texts = TokenTexts(state.engine)
    try:
        for choice in streams.choices:
            yield sse(_chunk(meta, choice.index, {"role": "assistant", "content": ""}))
        async for choice, delta in streams.events():
            if choice.failed:
                yield sse(failed_request(choice.finish_reason, choice.error).body())
                yield SSE_DONE
                return
            logprobs = None
            if body.logprobs and delta.token_ids:
                logprobs = chat_logprobs(texts, delta.token_ids, delta.logprobs or [], body.top_logprobs or 0)
            if delta.text or logprobs:
                yield sse(_chunk(meta, choice.index, {"content": delta.text}, logprobs=logprobs))
            if delta.finish_reason is not None:
                yield sse(_chunk(meta, choice.index, {}, finish_reason=delta.finish_reason))
        if meta.include_usage:
            yield sse({**meta.header("chat.completion.chunk"), "choices": [], "usage": usage(streams.choices)})
        yield SSE_DONE
    finally:
        streams.close()
