"""POST /v1/completions: `text_completion` objects and events, with `echo`, batched prompts and
`suffix` (fill-in-the-middle: the prompt is the text before the cursor, see `fim`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.engine.api.engine_client import Prompt
from app.engine.types.outputs import StreamDelta, TopLogprobs
from app.engine.types.sampling_params import SamplingParams
from app.server.context_overflow import truncated, truncation_length
from app.server.fim import build_fim_prompt, engine_encoder, require_fim
from app.server.logprobs import completion_logprobs
from app.server.openai_schema import CompletionRequest
from app.server.response_format import constrained_params, output_constraint
from app.server.serving import Endpoint, ServerState, handle_generation
from app.server.streams import Choice


async def completions(body: CompletionRequest, request: Request) -> Response:
    return await handle_generation(request, body, _Completion)


class _Completion(Endpoint):
    """Raw prompts (text or token ids, n choices each); the reply is text, after the prompt with `echo`."""

    id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, body: CompletionRequest) -> None:
        constraint = output_constraint(body)
        # max_tokens None: up to the end of the context.
        params = constrained_params(body, body.max_tokens, body.logprobs, constraint)
        prompts: list[Prompt]
        # What `echo` repeats: the prompt as sent, or the part of it the engine reads.
        self._echo_prompts: list[Prompt] = list(body.prompt)
        if body.suffix is not None:
            prompts, params = _fim_prompts(state, body, params)
            self._echo_prompts = list(prompts)
        else:
            keep = truncation_length(body.truncate_prompt_tokens, state.engine.max_model_len, body.max_tokens)
            cuts = [truncated(state, p, keep) for p in body.prompt]
            prompts = [ids for ids, _ in cuts]
            self._echo_prompts = [ids if cut else p for p, (ids, cut) in zip(body.prompt, cuts)]
        super().__init__(state, prompts, params, constraint.renames() if constraint else None)
        self.body = body
        self._echoes: list[str] = []
        # Character offset where each choice's next delta starts (after its echoed prompt).
        self._offsets: dict[int, int] = {}

    def accepted(self) -> None:
        # Decoded only now: the engine has accepted the token ids.
        self._echoes = [self._prompt_text(p) if self.body.echo else "" for p in self._echo_prompts]

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        echo = self._echoes[choice.prompt_index]
        return [_entry(choice, echo)] if echo else []

    def streamed(self, choice: Choice, delta: StreamDelta) -> list[dict[str, Any]]:
        offset = self._offsets.get(choice.index, len(self._echoes[choice.prompt_index]))
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [], offset) if delta.token_ids else None
        self._offsets[choice.index] = offset + len(delta.text)
        if delta.text or logprobs or delta.finish_reason is not None:
            return [_entry(choice, delta.text, delta.finish_reason, logprobs)]
        return []

    def whole(self, choice: Choice) -> dict[str, Any]:
        echo = self._echoes[choice.prompt_index]
        logprobs = self._logprobs(choice.token_ids, choice.logprobs, len(echo))
        return _entry(choice, echo + "".join(choice.text), choice.finish_reason, logprobs)

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else self.state.engine.decode(list(prompt))  # type: ignore[arg-type]

    def _logprobs(self, token_ids: list[int], dists: list[TopLogprobs], offset: int) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(self.texts, token_ids, dists, self.body.logprobs, offset)


def _fim_prompts(state: ServerState, body: CompletionRequest,
                 params: SamplingParams) -> tuple[list[Prompt], SamplingParams]:
    """With `suffix`, each prompt is the text before the cursor of a fill-in-the-middle prompt;
    the model's FIM end tokens stop the reply too (as llama.cpp's end-of-generation tokens)."""
    engine = state.engine
    fim_tokens = require_fim(engine, "suffix")
    encode, bos = engine_encoder(engine)
    suffix = body.suffix or ""
    prompts: list[Prompt] = [build_fim_prompt(encode, fim_tokens, p, suffix, bos=bos, max_model_len=engine.max_model_len,
                                              n_predict=body.max_tokens).token_ids for p in body.prompt]
    stop_ids = [*params.stop_token_ids, *(t for t in fim_tokens.end_ids if t not in params.stop_token_ids)]
    return prompts, dataclasses.replace(params, stop_token_ids=stop_ids)


def _entry(choice: Choice, text: str, finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
