"""POST /infill: llama.cpp's code-completion route, which editor plugins (llama.vim, llama.vscode)
call with the text around the cursor; the server builds the fill-in-the-middle prompt (`fim`).

Request and response follow llama-server's `/infill` (its `/completion` result, llama.cpp's
defaults for omitted sampling fields), so a plugin pointed here reads `content`, `timings`,
`tokens_cached`, `truncated` and `stop_type` as it does there. Streaming sends llama.cpp's
`data: {...}` events, without OpenAI's `[DONE]`; the last one has `stop: true` and the totals."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse, Response

from app.engine.types.context_window import reply_room
from app.engine.types.fim import FimTokens
from app.engine.types.sampling_params import SamplingParams
from app.server.fim import ExtraChunk, FimPrompt, build_fim_prompt, engine_encoder, require_fim
from app.server.http_errors import engine_error, failed_request
from app.server.openai_schema import INT64_MAX, StopSchema, Text
from app.server.serving import EventStreamResponse, ServerState, client_closed, server_state, sse
from app.server.streams import Choice, ClientGone, Job, MultiStream, until_disconnect

# llama.cpp's seed for "random" (LLAMA_DEFAULT_SEED), besides any negative value.
RANDOM_SEED = 0xFFFFFFFF
_CHUNK_SHAPE = 'an array of {"filename": string, "text": string}'


class _Body(BaseModel):
    # As the OpenAI routes' bodies: strict types, unknown fields ignored.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class InfillChunk(_Body):
    filename: Text = "tmp"
    text: Text


class InfillRequest(_Body):
    """llama-server's /infill fields; unknown ones (`samplers`, `t_max_prompt_ms`, `id_slot`...)
    are ignored, as `cache_prompt` is in effect (the prefix cache is always on)."""

    model: Text | None = None
    input_prefix: Text
    input_suffix: Text
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: Text = ""  # text after input_prefix (llama.vim: the cursor line up to the cursor)
    n_predict: Annotated[int, Field(ge=-1, le=2**31 - 1)] = -1  # -1: up to the context; 0: prefill only
    stream: bool = False
    # llama.cpp's defaults, not OpenAI's: plugins tuned against llama-server rely on them.
    temperature: float = 0.8
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Annotated[int, Field(le=INT64_MAX)] | None = None  # negative or 0xFFFFFFFF: random
    stop: Annotated[list[Text] | None, StopSchema] = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    # Stop once this long has passed since the first token and a newline has been generated.
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0
    # Stop at a line (after the first) indented less than this many spaces or tabs.
    n_indent: Annotated[int, Field(ge=0)] = 0
    # Only these fields of the result, by path ("timings/prompt_n"), as flat keys.
    response_fields: list[str] | None = None

    @field_validator("input_extra", mode="before")
    @classmethod
    def _chunks(cls, value: Any) -> Any:
        """llama.cpp's checks, with its meaning: `text` is required, `filename` optional."""
        if value is None:
            return []
        if not isinstance(value, list):
            raise ValueError(f"must be {_CHUNK_SHAPE}")  # noqa: TRY004 - pydantic reports only ValueError
        out = []
        for i, chunk in enumerate(value):
            if not isinstance(chunk, dict):
                raise ValueError(f"chunk {i} is not an object; send {_CHUNK_SHAPE}")
            if not isinstance(chunk.get("text"), str):
                raise ValueError(f'chunk {i} needs a "text" field with a string value')
            name = chunk.get("filename")
            if name is not None and not isinstance(name, str):
                raise ValueError(f'chunk {i}: "filename" must be a string')
            out.append({"text": chunk["text"], **({"filename": name} if name is not None else {})})
        return out

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def sampling_params(self, fim: FimTokens, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        """n_predict is cut to what the context leaves (llama.cpp stops there too); 0 (llama.vim's
        cache warm-up) still samples one token, which is not returned."""
        max_tokens = reply_room(max_model_len, num_prompt_tokens, None if self.n_predict < 0 else max(self.n_predict, 1))
        seed = None if self.seed is None or self.seed < 0 or self.seed == RANDOM_SEED else self.seed
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repetition_penalty=self.repeat_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              seed=seed, stop=list(self.stop or []), stop_token_ids=fim.end_ids,
                              ignore_eos=self.ignore_eos)

    def settings(self) -> dict[str, Any]:
        """The result's `generation_settings` (the fields this route acts on)."""
        return {"n_predict": self.n_predict, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "min_p": self.min_p, "repeat_penalty": self.repeat_penalty,
                "seed": self.seed, "stop": self.stop or [], "n_indent": self.n_indent,
                "t_max_predict_ms": self.t_max_predict_ms, "stream": self.stream, "cache_prompt": self.cache_prompt}


async def infill(body: InfillRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    state = server_state(request)
    model = state.check_model(body.model)
    engine = state.engine
    fim = require_fim(engine, "input_prefix")
    encode, bos = engine_encoder(engine)
    extra = [ExtraChunk(c.text, c.filename) for c in body.input_extra]
    built = build_fim_prompt(encode, fim, body.input_prefix, body.input_suffix, prompt=body.prompt, extra=extra,
                             bos=bos, max_model_len=engine.max_model_len,
                             n_predict=body.n_predict if body.n_predict >= 0 else None)
    params = body.sampling_params(fim, engine.max_model_len, len(built.token_ids))
    streams = MultiStream(engine, [Job(built.token_ids, params)], f"infill-{uuid.uuid4().hex[:12]}", state.metrics,
                          arrival)
    try:
        await until_disconnect(request, streams.start())
    except ClientGone:
        return client_closed()
    except Exception as exc:  # engine_error re-raises what is not an engine error
        raise engine_error(exc) from exc
    run = _InfillRun(state, body, model, streams, built, arrival)
    if body.stream:
        return EventStreamResponse(run.events())
    try:
        await until_disconnect(request, run.collect())
    except ClientGone:
        return client_closed()
    finally:
        streams.close()
    if run.choice.failed:
        raise failed_request(run.choice.finish_reason, run.choice.error)
    return JSONResponse(run.result(run.content))


class _InfillRun:
    """One /infill request's generation: the text so far, llama.cpp's extra stops (n_indent,
    t_max_predict_ms), and its result objects."""

    def __init__(self, state: ServerState, body: InfillRequest, model: str, streams: MultiStream, built: FimPrompt,
                 arrival: float) -> None:
        self.state, self.body, self.model, self.streams, self.built = state, body, model, streams, built
        self.arrival = arrival
        self.choice: Choice = streams.choices[0]
        self.content = ""
        self.limited = False  # stopped here (n_indent, t_max_predict_ms) rather than by the engine
        self.end_time: float | None = None

    async def _pieces(self) -> AsyncIterator[str]:
        """The content as it grows, cut where llama.cpp's extra stops cut it; aborts the engine
        request once one of them has stopped it."""
        events = self.streams.events()
        try:
            async for choice, delta in events:
                if choice.failed:
                    return
                piece = self._accept(delta.text)
                if piece:
                    yield piece
                if self.limited:
                    self.streams.close()  # frees the KV blocks now
                    return
        finally:
            self.end_time = time.perf_counter()
            await events.aclose()

    def _accept(self, text: str) -> str:
        """Add `text` to the content; return the part to send (cut when a limit stops it here)."""
        if self.body.n_predict == 0:
            return ""
        start = len(self.content)
        self.content += text
        if self.body.n_indent > 0 and text:
            line = self.content.rfind("\n", 0, start)  # the line that was open may end up too short
            cut = indent_cut(self.content, line if line >= 0 else start, self.body.n_indent)
            if cut is not None:
                self.content = self.content[:cut]
                self.limited = True
        first = self.choice.first_token_time
        if (self.body.t_max_predict_ms > 0 and first is not None and "\n" in self.content
                and (time.perf_counter() - first) * 1000 > self.body.t_max_predict_ms):
            self.limited = True
        return self.content[start:]

    async def collect(self) -> None:
        async for _ in self._pieces():
            pass

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._pieces():
                yield sse({"index": 0, "content": piece, "stop": False, "tokens_predicted": self._predicted(),
                           "tokens_evaluated": self.choice.num_prompt_tokens})
            if self.choice.failed:
                # The 200 has been sent: the error can only be one more event.
                yield sse(failed_request(self.choice.finish_reason, self.choice.error).body())
                return
            yield sse(self.result(""))
        finally:
            self.streams.close()

    def _predicted(self) -> int:
        return 0 if self.body.n_predict == 0 else self.choice.num_output_tokens

    def _stop(self) -> tuple[str, str]:
        """llama.cpp's stop_type ("eos", "limit", "word") and stopping_word."""
        if self.limited or self.choice.finish_reason == "length":
            return "limit", ""
        stops = [s for s in self.body.stop or [] if s]
        if self.choice.finish_reason == "stop" and stops:
            # The engine cuts the stop string off the text; the tokens still spell it.
            generated = self.state.engine.decode(self.choice.token_ids)
            found = sorted((i, s) for s in stops if (i := generated.find(s)) >= 0)
            if found:
                return "word", found[0][1]
        return "eos", ""

    def result(self, content: str) -> dict[str, Any]:
        """The final result (`content` "" when streamed: the events carried it)."""
        choice = self.choice
        stop_type, word = self._stop()
        first = choice.first_token_time
        end = self.end_time or time.perf_counter()
        prompt_ms = ((first or end) - self.arrival) * 1000
        predicted_ms = (end - first) * 1000 if first is not None else 0.0
        prompt_n = max(0, choice.num_prompt_tokens - choice.num_cached_tokens)
        predicted_n = self._predicted()
        timings = {
            "cache_n": choice.num_cached_tokens,
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_ms * 1000 if predicted_ms > 0 else 0.0,
        }
        # tokens_cached is llama-server's: every token the cache holds for this request (its slot's
        # n_past), which llama.vim shows against the context; timings.cache_n is the prefix reused.
        out = {
            "index": 0, "content": content, "stop": True, "model": self.model,
            "tokens_predicted": predicted_n, "tokens_evaluated": choice.num_prompt_tokens,
            "tokens_cached": choice.num_prompt_tokens + predicted_n, "truncated": self.built.truncated,
            "has_new_line": "\n" in self.content, "stop_type": stop_type, "stopping_word": word,
            "generation_settings": self.body.settings(), "timings": timings,
        }
        return pick_fields(out, self.body.response_fields) if self.body.response_fields else out


def indent_cut(text: str, start: int, n_indent: int) -> int | None:
    """llama.cpp's n_indent: where to cut `text` when a line after the first (a newline at or after
    `start` begins it) has something other than spaces and tabs before column `n_indent`; the
    cut keeps that line's indentation, as llama.cpp does."""
    i = text.find("\n", start)
    while i >= 0:
        j = i + 1
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and j - i - 1 < n_indent:
            return j
        i = text.find("\n", i + 1)
    return None


def pick_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: each path found ("timings/prompt_n") as a flat key."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out
