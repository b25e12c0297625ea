"""The FastAPI application: routes, error objects, API-key check, request-size limit and CORS."""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.engine.api.engine_client import EngineClient
from app.server import chat_completions, completions, infill, routes
from app.server.http_errors import ApiError, install_error_handlers
from app.server.prometheus import CONTENT_TYPE, ServerMetrics
from app.server.serving import ServerState

# Reachable without the API key: load balancers and supervisors probe it.
OPEN_PATHS = frozenset({"/health"})
# Far above any prompt that fits a context window; keeps a hostile body from filling memory.
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class CorsPolicy:
    """Cross-origin access for browser clients (vLLM's flags); off unless origins are given.
    Preflight requests are answered before the API-key check: browsers never send the key there."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def create_app(engine: EngineClient, *, api_key: str | None = None,
               served_model_name: str | Sequence[str] | None = None, cors: CorsPolicy | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`. With `api_key`, every route but /health needs
    `Authorization: Bearer <api_key>`. `served_model_name`: the name(s) requests may use (the
    first is answered); without it, the engine's current `model_name`."""
    app = FastAPI(title="localbatch", version=__version__,
                  description="OpenAI-compatible endpoint of the localbatch engine")
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name or ())
    app.state.localbatch = state = ServerState(engine, names, ServerMetrics(), int(time.time()))
    install_error_handlers(app)
    _add_routes(app)
    app.add_middleware(MetricsEndpoint, state=state)
    app.add_middleware(GuardMiddleware, api_key=api_key)
    if cors is not None and cors.allowed_origins:
        # Added last, so it runs first: preflights never reach the key check, and error
        # responses (401 included) carry the CORS headers a browser needs to read them.
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers))
    return app


def _add_routes(app: FastAPI) -> None:
    post, get = ["POST"], ["GET"]
    # Each OpenAI route also without /v1, as llama-server and Ollama accept it.
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat_completions.chat_completions, methods=post,
                          response_model=None)
        app.add_api_route(f"{prefix}/completions", completions.completions, methods=post, response_model=None)
        app.add_api_route(f"{prefix}/models", routes.list_models, methods=get)
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", routes.get_model, methods=get)
    # llama.cpp's code-completion route (editor plugins call it; it has no /v1 form there).
    app.add_api_route("/infill", infill.infill, methods=post, response_model=None)
    app.add_api_route("/health", routes.health, methods=get)
    app.add_api_route("/kv_disk_cache/clear", routes.clear_kv_disk_cache, methods=post)
    app.add_api_route("/tokenize", routes.tokenize, methods=post)
    app.add_api_route("/detokenize", routes.detokenize, methods=post)


class MetricsEndpoint:
    """GET /metrics, answered below FastAPI's router (behind the API-key check): a scraper may poll
    at any rate, and routing and the Response object were a good part of a scrape's time."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        state = self.state
        body = state.metrics.render(state.engine.stats(), state.model_name).encode()
        headers = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """API-key check and body-size limit, as plain ASGI so that streaming responses and disconnect
    detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await self._reject(scope, receive, send, ApiError(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"}))
                return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            await self._reject(scope, receive, send, self._too_large())
            return
        await self.app(scope, self._limited(receive), send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body larger than {self.max_body_bytes} bytes or with a bad Content-Length")

    def _limited(self, receive: Receive) -> Receive:
        """Counts chunked bodies too, which carry no Content-Length."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _BodyTooLarge(self._too_large().message)
            return message

        return limited

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        await error.response()(scope, receive, send)
