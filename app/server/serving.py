"""What the chat and completions routes share: server state, model check, fanning a request out
into engine requests, disconnect handling, the SSE response, and `handle_generation`, the one
handler both run, each with an `Endpoint` that says what differs."""

from __future__ import annotations

import dataclasses
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import StreamDelta
from app.engine.types.sampling_params import SamplingParams
from app.server import compact_json
from app.server.http_errors import ApiError, engine_error, failed_request
from app.server.logprobs import TokenTexts
from app.server.openai_schema import SamplingRequest
from app.server.prometheus import ServerMetrics
from app.server.streams import (
    Choice,
    ClientGone,
    Job,
    MultiStream,
    until_disconnect,
    usage,
)

# nginx's "client closed request": logged, never seen by the client.
CLIENT_CLOSED = 499
_SEED_SPACE = 2**63
Body = TypeVar("Body", bound=SamplingRequest)


@dataclass
class ServerState:
    engine: EngineClient
    # --served-model-name: the names requests may use, the first one answered. Empty: the engine's
    # current model name, read per request (the app can switch models while serving).
    served_names: tuple[str, ...]
    metrics: ServerMetrics
    created: int

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_names or (self.engine.model_name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to answer with: `model` when it is served, the served name when it is absent
        or empty; anything else is a 404."""
        names = self.model_names
        if not model:
            return names[0]
        if model not in names:
            served = ", ".join(repr(n) for n in names)
            raise ApiError(404, f"model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return model

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The templated prompt; a template that rejects the conversation is the client's error."""
        try:
            return self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except (LocalbatchError, ValueError) as exc:
            raise ApiError(400, f"messages: the chat template rejected them: {exc}", param="messages") from exc


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.localbatch
    return state


@dataclass(frozen=True)
class ResponseMeta:
    """The fields every response object and chunk of one request repeats."""

    id: str
    created: int
    model: str
    include_usage: bool = False

    @classmethod
    def new(cls, prefix: str, model: str, include_usage: bool = False) -> ResponseMeta:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, include_usage)

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of a seeded request uses seed + i, so that n choices differ but repeat exactly.
    Seeds are folded into [0, 2**63) so that the engine only ever sees non-negative int64 seeds."""
    if params.seed is None:
        return params
    seed = (params.seed + choice) % _SEED_SPACE
    return params if seed == params.seed else dataclasses.replace(params, seed=seed)


def fan_out(prompts: list[Prompt], params: SamplingParams, n: int) -> list[Job]:
    """Choice index = prompt index * n + j, as in OpenAI's batched completions."""
    return [Job(prompt, choice_params(params, j), p) for p, prompt in enumerate(prompts) for j in range(n)]


async def start_streams(request: Request, state: ServerState, jobs: list[Job], endpoint: Endpoint,
                        arrival: float) -> MultiStream | None:
    """Submit the engine requests; None when the client left while they were starting."""
    base_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex[:12]}"
    streams = MultiStream(state.engine, jobs, base_id, state.metrics, arrival)
    try:
        await until_disconnect(request, streams.start())
    except ClientGone:
        return None
    except Exception as exc:  # engine_error re-raises what is not an engine error
        raise engine_error(exc, endpoint.renames) from exc
    return streams


async def collect(request: Request, streams: MultiStream) -> MultiStream | None:
    """Run to completion (non-streaming); None when the client left first."""
    try:
        await until_disconnect(request, streams.collect())
    except ClientGone:
        return None
    finally:
        streams.close()
    return streams


def client_closed() -> Response:
    return Response(status_code=CLIENT_CLOSED)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + compact_json.dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, even when the client disconnects while
    a chunk is being sent (Starlette would leave it suspended), so its `finally` aborts the engine
    requests at once."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


class Endpoint(ABC):
    """What one request of a generation route asks the engine for, and how its choices look;
    `handle_generation` does everything else, so chat and completions check, stream, collect and
    fail alike."""

    id_prefix: ClassVar[str]
    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, state: ServerState, prompts: list[Prompt], params: SamplingParams,
                 renames: dict[str, str] | None = None) -> None:
        self.state = state
        self.prompts = prompts
        self.params = params
        # Engine field -> request field, for the `param` of errors the engine raises.
        self.renames = renames or {}
        # Per request: a token the logprobs name again and again is decoded once.
        self.texts = TokenTexts(state.engine)
        # Extra response headers (streamed or not), e.g. that the oldest messages were dropped.
        self.headers: dict[str, str] = {}

    def accepted(self) -> None:
        """Called once the engine has accepted the prompts, before anything is formatted."""

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        """The `choices[]` entries a stream sends for `choice` before its first delta."""
        return []

    @abstractmethod
    def streamed(self, choice: Choice, delta: StreamDelta) -> list[dict[str, Any]]:
        """The `choices[]` entries, one chunk each, that `delta` (already added to `choice`) streams."""

    @abstractmethod
    def whole(self, choice: Choice) -> dict[str, Any]:
        """The `choices[]` entry of a finished choice in the non-streaming response."""


async def handle_generation(request: Request, body: Body,
                            endpoint_for: Callable[[ServerState, Body], Endpoint]) -> Response:
    """The handler of both generation routes: `endpoint_for(state, body)` turns the checked request into
    prompts and sampling settings; the reply is an event stream or one JSON object."""
    arrival = time.perf_counter()
    state = server_state(request)
    model = state.check_model(body.model)
    body.check_combinations()
    endpoint = endpoint_for(state, body)
    jobs = fan_out(endpoint.prompts, endpoint.params, body.n)
    streams = await start_streams(request, state, jobs, endpoint, arrival)
    if streams is None:
        return client_closed()
    endpoint.accepted()
    meta = ResponseMeta.new(endpoint.id_prefix, model, body.include_usage)
    if body.stream:
        return EventStreamResponse(_events(streams, meta, endpoint), endpoint.headers)
    if await collect(request, streams) is None:
        return client_closed()
    return JSONResponse(_response(streams.choices, meta, endpoint), headers=endpoint.headers or None)


def _response(choices: list[Choice], meta: ResponseMeta, endpoint: Endpoint) -> dict[str, Any]:
    for choice in choices:
        if choice.failed:
            raise failed_request(choice.finish_reason, choice.error)
    out = meta.header(endpoint.response_object)
    out["choices"] = [endpoint.whole(c) for c in choices]
    out["usage"] = usage(choices)
    return out


def _chunk_writer(meta: ResponseMeta, obj: str) -> Callable[[dict[str, Any]], bytes]:
    """The SSE event of one chunk carrying `entry`: the fields every chunk of the request repeats
    are encoded once, not once per token."""
    head = compact_json.dumps(meta.header(obj))[:-1]
    prefix = f'data: {head},"choices":['.encode()
    # OpenAI sends an explicit null usage on every chunk but the last.
    suffix = b'],"usage":null}\n\n' if meta.include_usage else b"]}\n\n"

    def chunk(entry: dict[str, Any]) -> bytes:
        return prefix + compact_json.dumps(entry).encode() + suffix

    return chunk


async def _events(streams: MultiStream, meta: ResponseMeta, endpoint: Endpoint) -> AsyncIterator[bytes]:
    obj = endpoint.chunk_object
    chunk = _chunk_writer(meta, obj)
    try:
        for choice in streams.choices:
            for entry in endpoint.opening(choice):
                yield chunk(entry)
        async for choice, delta in streams.events():
            if choice.failed:
                # The 200 has been sent: the error can only be one more event.
                yield sse(failed_request(choice.finish_reason, choice.error).body())
                yield SSE_DONE
                return
            for entry in endpoint.streamed(choice, delta):
                yield chunk(entry)
        if meta.include_usage:
            yield sse({**meta.header(obj), "choices": [], "usage": usage(streams.choices)})
        yield SSE_DONE
    finally:
        streams.close()
