"""Malformed and odd request bodies never get a 500 or hang the server, and it keeps serving."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fake_engine import FakeEngine, ServerThread

POSTS = ["/v1/chat/completions", "/v1/completions"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])



def rarely(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`odd` one time in ten (st.one_of would pick each branch about equally often)."""
    return st.sampled_from([False] * 9 + [True]).flatmap(lambda is_odd: odd if is_odd else usual)


def text(max_size: int) -> st.SearchStrategy[str]:
    """Any text, sometimes with unpaired surrogates (valid JSON escapes that no tokenizer accepts)."""
    surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
    return rarely(st.text(max_size=max_size), surrogates)


json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
             | st.floats(allow_nan=True, allow_infinity=True) | text(20))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(text(8), inner, max_size=4), max_leaves=12)


part = st.fixed_dictionaries({"type": rarely(st.just("text"), st.just("image_url")), "text": text(10)})
message = st.fixed_dictionaries({
    "role": rarely(st.sampled_from(["system", "developer", "user", "assistant"]), st.just("tool")),
    "content": rarely(text(30), st.lists(part, min_size=1, max_size=3)),
})
# The fake vocabulary has 259 ids; one in ten is out of it.
token_ids = rarely(st.integers(0, 258), st.sampled_from([259, 2**31]))
# Plausible values: most of them valid, a few out of range.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["fake-model", "fake-model", "", "other"]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "max_tokens": st.integers(0, 40),
    "max_completion_tokens": st.integers(0, 40),
    "temperature": st.floats(-0.1, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 300),
    "min_p": st.floats(0, 1.1),
    "presence_penalty": st.floats(-2, 2.1),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": text(5) | st.lists(text(5), max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "n": st.integers(0, 4),
    "ignore_eos": st.booleans(),
}
CHAT_FIELDS = {**FIELDS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 21)}
COMPLETION_FIELDS = {**FIELDS, "logprobs": st.integers(0, 21), "echo": st.booleans()}
prompts = text(40) | st.lists(token_ids, min_size=1, max_size=10) | st.lists(text(10), min_size=1, max_size=3)


def near_valid(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """A plausible body; one time in three one field (known or not) is replaced by any JSON value."""
    chat = path == POSTS[0]
    required = {"messages": st.lists(message, min_size=1, max_size=3)} if chat else {"prompt": prompts}
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    body = st.fixed_dictionaries(required, optional=fields)
    names = st.sampled_from([*required, *fields, "tools", "logit_bias", "response_format", "suffix", "best_of"])
    corrupt = st.tuples(body, names, json_value).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(body, body, corrupt)


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    """Served by tests/server/conftest.py's `server` and `client`. A short context and fast steps
    keep the requests that are valid quick."""
    return FakeEngine(max_model_len=64, step_delay=0.0005, max_num_seqs=256, max_waiting=1024, num_blocks=4096)


def check(response: httpx.Response, streaming: bool) -> None:
    """No 5xx; errors are OpenAI error objects; successes are complete."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    elif streaming:
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
        assert '"error"' not in response.text
    else:
        assert response.json()["choices"]


@FUZZ
@given(data=st.data(), path=st.sampled_from(POSTS))
def test_near_valid_bodies(client: httpx.Client, data: st.DataObject, path: str) -> None:
    body = data.draw(near_valid(path))
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    check(r, streaming=body.get("stream") is True)


@FUZZ
@given(path=st.sampled_from([*POSTS, "/tokenize", "/detokenize"]), body=json_value,
       content_type=st.sampled_from(["application/json", "text/plain", None]))
def test_arbitrary_json(client: httpx.Client, path: str, body: Any, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=json.dumps(body), headers=headers)
    check(r, streaming=False)
    if path in POSTS:
        assert r.status_code in (400, 404)


@FUZZ
@given(path=st.sampled_from(POSTS),
       raw=st.binary(max_size=200) | text(200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_garbage_bytes(client: httpx.Client, path: str, raw: bytes) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_serving_and_nothing_leaked(server: ServerThread, client: httpx.Client) -> None:
    r = client.post(POSTS[0], json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 3
    while server.engine.stats().num_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = server.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_blocks_used == 0
