"""The HTTP server over the real SmolLM2 engine with prompt lookup: a greedy reply, streamed or not,
is the text plain decoding gives; constrained requests beside it still validate; /metrics counts
the drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.test_real_model import MODEL, PERSON, matches
from tests.support.fake_engine import ServerThread

pytestmark = pytest.mark.slow
CODE = "def area(width, height):\n    result = width * height\n    print(result)\n    return result\n"
ASK = {"messages": [{"role": "user", "content": f"{CODE}\nRepeat this function exactly, in a code block."}],
       "temperature": 0, "max_tokens": 60}


def serve(speculative: bool) -> Iterator[httpx.Client]:
    from app.engine.api.async_engine import AsyncEngine
    from app.engine.gguf.catalog import installed_path

    if installed_path(MODEL) is None:
        pytest.skip(f"SmolLM2 is not pulled: run `localbatch pull {MODEL}` (the README's test command does)")
    config = {"method": "ngram", "num_speculative_tokens": 4} if speculative else None
    engine = AsyncEngine(model=MODEL, device="cpu", kv_cache_blocks=256, speculative_config=config)
    try:
        with ServerThread(engine) as server, httpx.Client(base_url=server.url, timeout=300) as c:
            yield c
    finally:
        engine.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[httpx.Client]:
    yield from serve(False)


@pytest.fixture(scope="module")
def spec() -> Iterator[httpx.Client]:
    yield from serve(True)


def streamed_text(client: httpx.Client, body: dict) -> str:
    parts = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(parts)


def test_greedy_replies_equal_plain_decoding_streamed_or_not(plain: httpx.Client, spec: httpx.Client) -> None:
    want = plain.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]["content"]
    got = spec.post("/v1/chat/completions", json=ASK).json()
    assert got["choices"][0]["message"]["content"] == want
    assert got["usage"]["completion_tokens"] > 0
    assert streamed_text(spec, ASK) == want
    metrics = spec.get("/metrics").text
    drafted = next(line for line in metrics.splitlines() if line.startswith("localbatch:spec_decode_num_draft_tokens_total"))
    assert float(drafted.split()[-1]) > 0


def test_constrained_requests_beside_speculation_still_validate(spec: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Invent a person."}], "temperature": 0.8, "seed": 7,
            "max_tokens": 60, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "person", "schema": PERSON}}}
    reply = spec.post("/v1/chat/completions", json=body).json()
    assert matches(json.loads(reply["choices"][0]["message"]["content"]), PERSON)
