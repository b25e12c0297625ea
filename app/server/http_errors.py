"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause maps to a 4xx here; 5xx is reserved for the engine failing on its
own (503) and for bugs (500)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.engine.types.errors import (
    EngineDeadError,
    LocalbatchError,
    QueueFullError,
    RequestError,
)

log = logging.getLogger(__name__)

# OpenAI's code for a prompt (plus max_tokens) that does not fit the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Seconds a client should wait before retrying when the engine's waiting queue is full.
RETRY_AFTER_S = 1

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """An error to send as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_error(exc: Exception, renames: Mapping[str, str] | None = None) -> ApiError:
    """Map what `EngineClient.stream` raises to an HTTP error; `renames` maps the engine's field
    names to the request's (the engine's "prompt" is a chat request's "messages")."""
    if isinstance(exc, RequestError):
        param = (renames or {}).get(exc.param or "", exc.param)
        code = CONTEXT_LENGTH_EXCEEDED if exceeds_context(exc) else None
        return ApiError(400, str(exc), param=param, code=code)
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc) or "the engine's waiting queue is full; retry later", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc) or "the engine has stopped", code="engine_dead")
    if isinstance(exc, LocalbatchError):
        return ApiError(503, str(exc), code="engine_error")
    raise exc


def exceeds_context(exc: RequestError) -> bool:
    """The request does not fit the context window (the prompt alone, or with max_tokens)."""
    if getattr(exc, "code", None) == CONTEXT_LENGTH_EXCEEDED:
        return True
    # The engine says so in words, on the field that does not fit.
    return exc.param in ("prompt", "max_tokens") and "context" in str(exc).lower()


def failed_request(reason: str | None, error: str | None) -> ApiError:
    """A request the engine ended with finish_reason "error" or "abort"."""
    if reason == "abort":
        return ApiError(503, "the request was aborted by the engine", code="aborted")
    return ApiError(503, f"the engine failed on this request: {error or 'unknown error'}", code="engine_error")


def param_path(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "malformed")
        return ApiError(400, f"request body is not valid JSON: {why} (at position {first['loc'][-1]})")
    param = param_path(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "required field is missing" if param else "request body is missing"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return ApiError(400, f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param)


async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _validation_error(list(exc.errors())).response()


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()


async def _on_engine_error(_: Request, exc: LocalbatchError) -> JSONResponse:
    return engine_error(exc).response()


async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error serving %s %s", request.method, request.url.path)
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    # Starlette types handlers as taking `Exception`; each of these gets only its own class.
    app.add_exception_handler(ApiError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(LocalbatchError, _on_engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_bug)
