"""Engine logprobs ({token_id: logprob} per sampled token) in OpenAI's chat and completions shapes."""

from __future__ import annotations

import math
from typing import Any

from app.engine.api.engine_client import EngineClient
from app.engine.types.outputs import TopLogprobs

# JSON has no -Infinity; OpenAI-compatible servers report impossible tokens with this floor.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else float(logprob)


def _top(dist: TopLogprobs, k: int) -> list[tuple[int, float]]:
    return sorted(dist.items(), key=lambda item: -item[1])[:k]


class TokenTexts:
    """Token id -> its text alone, decoded once per request."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self._engine.decode([token_id])
        return self._cache[token_id]


def chat_logprobs(texts: TokenTexts, token_ids: list[int], dists: list[TopLogprobs], k: int) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = texts(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    # An engine that sends fewer distributions than tokens gets fewer entries, not an error.
    for token_id, dist in zip(token_ids, dists, strict=False):
        item = entry(token_id, dist.get(token_id, LOGPROB_FLOOR))
        item["top_logprobs"] = [entry(t, lp) for t, lp in _top(dist, k)]
        content.append(item)
    return {"content": content}


def completion_logprobs(texts: TokenTexts, token_ids: list[int], dists: list[TopLogprobs], k: int,
                        offset: int) -> dict[str, Any]:
    """`choices[].logprobs` of a completion: parallel lists, `text_offset` counting from `offset`."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, dist in zip(token_ids, dists, strict=False):
        token = texts(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(_finite(dist.get(token_id, LOGPROB_FLOOR)))
        out["top_logprobs"].append({texts(t): _finite(lp) for t, lp in _top(dist, k)})
        out["text_offset"].append(offset)
        offset += len(token)
    return out
