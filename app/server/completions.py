"""POST /v1/completions: `text_completion` objects and events, with `echo` and batched prompts."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from app.engine.api.engine_client import Prompt
from app.server.http_errors import failed_request
from app.server.logprobs import TokenTexts, completion_logprobs
from app.server.openai_schema import CompletionRequest
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


async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    state = server_state(request)
    state.check_model(body.model)
    body.check_combinations()
    prompts: list[Prompt] = list(body.prompt)
    params = body.sampling_params(body.max_tokens, body.logprobs)  # None: up to the end of the context
    streams = await start_streams(request, state, fan_out(prompts, params, body.n), "cmpl", arrival)
    if streams is None:
        return client_closed()
    # Decoded only now: the engine has accepted the token ids.
    echoes = [_prompt_text(state, p) if body.echo else "" for p in prompts]
    meta = ResponseMeta.new("cmpl", state.model_name, body.include_usage)
    if body.stream:
        return EventStreamResponse(_events(streams, meta, state, body, echoes))
    if await collect(request, streams) is None:
        return client_closed()
    return JSONResponse(_response(streams.choices, meta, state, body, echoes))


def _prompt_text(state: ServerState, prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else state.engine.decode(list(prompt))  # type: ignore[arg-type]


def _response(choices: list[Choice], meta: ResponseMeta, state: ServerState, body: CompletionRequest,
              echoes: list[str]) -> dict[str, Any]:
    for choice in choices:
        if choice.failed:
            raise failed_request(choice.finish_reason, choice.error)
    texts = TokenTexts(state.engine)
    out = meta.header("text_completion")
    out["choices"] = []
    for c in choices:
        echo = echoes[c.prompt_index]
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(texts, c.token_ids, c.logprobs, body.logprobs, len(echo))
        out["choices"].append({"index": c.index, "text": echo + "".join(c.text), "logprobs": logprobs,
                               "finish_reason": c.finish_reason})
    out["usage"] = usage(choices)
    return out


def _chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    out = meta.header("text_completion")
    out["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    if meta.include_usage:
        out["usage"] = None
    return out


async def _events(streams: MultiStream, meta: ResponseMeta, state: ServerState, body: CompletionRequest,
                  echoes: list[str]) -> AsyncIterator[bytes]:
    texts = TokenTexts(state.engine)
    # Character offset where each choice's next delta starts (after its echoed prompt).
    offsets = [len(echoes[c.prompt_index]) for c in streams.choices]
    try:
        for choice in streams.choices:
            if echoes[choice.prompt_index]:
                yield sse(_chunk(meta, choice.index, echoes[choice.prompt_index]))
        async for choice, delta in streams.events():
            if choice.failed:
                yield sse(failed_request(choice.finish_reason, choice.error).body())
                yield SSE_DONE
                return
            logprobs = None
            if body.logprobs is not None and delta.token_ids:
                logprobs = completion_logprobs(texts, delta.token_ids, delta.logprobs or [], body.logprobs,
                                               offsets[choice.index])
            offsets[choice.index] += len(delta.text)
            if delta.text or logprobs or delta.finish_reason is not None:
                yield sse(_chunk(meta, choice.index, delta.text, delta.finish_reason, logprobs))
        if meta.include_usage:
            yield sse({**meta.header("text_completion"), "choices": [], "usage": usage(streams.choices)})
        yield SSE_DONE
    finally:
        streams.close()
