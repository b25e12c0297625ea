"""The small routes: /v1/models, /health, vLLM's /tokenize and /detokenize, and /kv_disk_cache/clear
(/metrics is `factory.MetricsEndpoint`)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.engine.types.errors import LocalbatchError
from app.server.http_errors import ApiError
from app.server.openai_schema import DetokenizeRequest, TokenizeRequest
from app.server.serving import ServerState, server_state
from app.server.tool_prompt import fallback_messages


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    # `root` is the model behind the name (vLLM's meaning); one engine serves every name.
    return {"id": name, "object": "model", "created": state.created, "owned_by": "localbatch",
            "root": state.engine.model_name, "parent": None, "max_model_len": state.engine.max_model_len}


async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}


async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    return _model_card(state, state.check_model(model_id or None))


async def health(request: Request) -> Response:
    server_state(request).engine.stats()  # raises EngineDeadError (-> 503) once the engine has stopped
    return Response(status_code=200)


async def clear_kv_disk_cache(request: Request) -> dict[str, Any]:
    """localbatch's own: remove the KV disk tier's block files (the app's palette action, remotely)."""
    return {"message": await server_state(request).engine.clear_kv_disk_cache()}


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.check_model(body.model)
    body.check_combinations()
    if body.messages is not None:
        text = state.render_chat(fallback_messages(body.messages, [], "none"), body.add_generation_prompt)
        # Chat templates write their own BOS.
        add_bos = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_bos = body.add_special_tokens is not False
    tokens = state.engine.encode(text, add_bos=add_bos)
    token_strs = [state.engine.decode([t]) for t in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens,
            "token_strs": token_strs}


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.check_model(body.model)
    try:
        text = state.engine.decode(body.tokens)
    except (LocalbatchError, ValueError, IndexError, OverflowError) as exc:
        # Ids past the vocabulary: the protocol does not expose its size, the tokenizer finds out.
        raise ApiError(400, f"tokens: cannot detokenize: {exc}", param="tokens") from exc
    return {"prompt": text}
