"""The OpenAI-compatible server, run for real (uvicorn on a loopback port) over the fake engine and
driven with httpx and the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from app.server import ServeError, serve
from tests.support.fake_engine import FakeEngine, FakeTokenizer, ServerThread

TOK = FakeTokenizer()
USER = [{"role": "user", "content": "Tell me something."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=512, step_delay=0.002)


def prompt_tokens(messages: list[dict[str, str]]) -> int:
    return len(TOK.encode(TOK.apply_chat_template(messages)))


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body strictly: every event is one `data: ...` line followed by a blank line."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_for(predicate: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# --- chat ---------------------------------------------------------------------------------------


def test_chat_non_streaming(oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    out = oai.chat.completions.create(model="fake-model", messages=messages, max_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "fake-model"
    (choice,) = out.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.message.content) == 10  # one ASCII character per fake token
    assert out.usage.prompt_tokens == prompt_tokens(messages)
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_chat_streaming_matches_non_streaming(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=15, temperature=0)
    chunks = list(oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=15, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == prompt_tokens(USER)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_shape(client: httpx.Client) -> None:
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])  # only with stream_options.include_usage
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_text_parts_equal_string_content(client: httpx.Client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "something."}]}]
    joined = [{"role": "user", "content": "Tell me\nsomething."}]
    a = client.post(CHAT, json={"messages": parts, "max_tokens": 12, "temperature": 0}).json()
    b = client.post(CHAT, json={"messages": joined, "max_tokens": 12, "temperature": 0}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


def test_model_may_be_absent_or_empty(client: httpx.Client) -> None:
    for extra in ({}, {"model": ""}, {"model": "fake-model"}):
        assert client.post(CHAT, json={"messages": USER, "max_tokens": 2, **extra}).status_code == 200


def test_default_max_tokens_fills_the_context(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(COMPLETIONS, json={"prompt": [5] * 500})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == engine.max_model_len - 500
    assert r.json()["choices"][0]["finish_reason"] == "length"


# --- completions --------------------------------------------------------------------------------


def test_completions(oai: openai.OpenAI) -> None:
    out = oai.completions.create(model="fake-model", prompt="Hello", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert len(out.choices[0].text) == 8 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(TOK.encode("Hello")) and out.usage.completion_tokens == 8
    chunks = list(oai.completions.create(model="fake-model", prompt="Hello", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_token_ids_echo_and_batch(client: httpx.Client) -> None:
    ids = TOK.encode("Hi", add_bos=False)
    r = client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 3, "echo": True, "temperature": 0}).json()
    assert r["choices"][0]["text"].startswith("Hi") and len(r["choices"][0]["text"]) == 5
    assert r["usage"]["prompt_tokens"] == len(ids)
    batch = client.post(COMPLETIONS, json={"prompt": ["a", "bb"], "n": 2, "max_tokens": 2}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["usage"]["prompt_tokens"] == len(TOK.encode("a")) + len(TOK.encode("bb"))
    assert batch["usage"]["completion_tokens"] == 8
    streamed = sse_events(client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "echo": True,
                                                         "stream": True}).text)
    assert streamed[0]["choices"][0]["text"] == "Hi"


# --- sampling controls --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client: httpx.Client, stream: bool) -> None:
    plain = client.post(CHAT, json={"messages": USER, "max_tokens": 60, "temperature": 0}).json()
    text = plain["choices"][0]["message"]["content"]
    stop = text.split(" ")[2]
    body = {"messages": USER, "max_tokens": 60, "temperature": 0, "stop": [stop, "never-generated"], "stream": stream}
    r = client.post(CHAT, json=body)
    if stream:
        events = sse_events(r.text)[:-1]
        got = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        got, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
    assert got == text[:text.index(stop)] and finish == "stop"


def test_max_completion_tokens_wins(client: httpx.Client) -> None:
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 7, "max_completion_tokens": 3}).json()
    assert r["usage"]["completion_tokens"] == 3


def test_ignore_eos_and_stop_token_ids() -> None:
    with ServerThread(FakeEngine(eos_after=4)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        early = c.post(CHAT, json={"messages": USER, "max_tokens": 10}).json()
        assert early["choices"][0]["finish_reason"] == "stop" and early["usage"]["completion_tokens"] == 5
        full = c.post(CHAT, json={"messages": USER, "max_tokens": 10, "ignore_eos": True}).json()
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 10
        space = TOK.encode(" ", add_bos=False)[0]
        body = {"messages": USER, "max_tokens": 30, "ignore_eos": True, "stop_token_ids": [space]}
        word = c.post(CHAT, json=body).json()
        content = word["choices"][0]["message"]["content"]
        # like vLLM, a stop token that is not special stays in the text
        assert word["choices"][0]["finish_reason"] == "stop" and content.index(" ") == len(content) - 1
        assert word["usage"]["completion_tokens"] == len(content)


def test_n_choices_use_distinct_requests_and_seeds(oai: openai.OpenAI, engine: FakeEngine) -> None:
    before = len(engine.submitted)
    out = oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=12, n=3, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    submitted = engine.submitted[before:]
    assert len({s.request_id for s in submitted}) == 3
    assert sorted(s.params.seed for s in submitted) == [11, 12, 13]
    assert out.usage.prompt_tokens == prompt_tokens(USER)  # the prompt is counted once
    assert out.usage.completion_tokens == 36
    assert len({c.message.content for c in out.choices}) > 1


def test_n_choices_streaming(client: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 5, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(client.post(CHAT, json=body).text)
    ends = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    finished = sorted(choice["index"] for choice in ends)
    assert finished == [0, 1, 2]
    assert events[-2]["usage"]["completion_tokens"] == 15


def test_seed_reproducibility(client: httpx.Client) -> None:
    def run(seed: int, path: str = CHAT) -> str:
        body: dict[str, Any] = {"max_tokens": 30, "temperature": 1.0, "seed": seed}
        body |= {"messages": USER} if path == CHAT else {"prompt": "Once"}
        choice = client.post(path, json=body).json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    assert run(5) == run(5) and run(5) != run(6)
    assert run(5, COMPLETIONS) == run(5, COMPLETIONS)


def test_logprobs_shapes(client: httpx.Client) -> None:
    chat = client.post(CHAT, json={"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert "".join(item["token"] for item in content) == chat["choices"][0]["message"]["content"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode()) and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    cmpl = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 4, "logprobs": 1}).json()
    lp = cmpl["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == cmpl["choices"][0]["text"] and lp["text_offset"] == [0, 1, 2, 3]
    assert all(len(top) == 1 for top in lp["top_logprobs"])
    plain = client.post(CHAT, json={"messages": USER, "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None



@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streamed_logprobs_add_up_to_the_whole_response(client: httpx.Client, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
    body |= {"messages": USER, "logprobs": True, "top_logprobs": 2} if path == CHAT else {"prompt": "Hi", "logprobs": 2}
    whole = client.post(path, json=body).json()["choices"][0]["logprobs"]
    events = sse_events(client.post(path, json={**body, "stream": True}).text)[:-1]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert len(parts) > 1
    # Completions: text_offset goes on counting from chunk to chunk.
    assert {key: [item for part in parts for item in part[key]] for key in whole} == whole


def test_completions_stream_batch_with_echo_and_usage(client: httpx.Client) -> None:
    body: dict[str, Any] = {"prompt": ["a", "bb"], "n": 2, "max_tokens": 3, "echo": True, "temperature": 0}
    whole = client.post(COMPLETIONS, json=body).json()
    events = sse_events(client.post(COMPLETIONS, json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events[:-1])
    texts = ["", "", "", ""]
    finishes: dict[int, str] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        assert event["usage"] is None
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == [c["text"] for c in whole["choices"]]
    # Every choice's echoed prompt comes first, before any generated text.
    assert [e["choices"][0]["text"] for e in events[:4]] == ["a", "a", "bb", "bb"]
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}


# --- concurrency and disconnects ------------------------------------------------------------------


def test_eight_concurrent_streams_batch_together(server: ServerThread, engine: FakeEngine) -> None:
    steps_before = len(engine.batch_sizes)

    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 40, "stream": True}
        async with c.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            return (await r.aread()).decode()

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    bodies = asyncio.run(main())
    for body in bodies:
        events = sse_events(body)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert max(engine.batch_sizes[steps_before:]) == 8


def test_disconnect_mid_stream_aborts(server: ServerThread, engine: FakeEngine) -> None:
    aborted_before = len(engine.aborted)
    body = {"messages": USER, "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=server.url, timeout=10) as c, c.stream("POST", CHAT, json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert engine.stats().num_blocks_used > 0
    assert wait_for(lambda: len(engine.aborted) == aborted_before + 1)
    assert wait_for(lambda: engine.stats().num_blocks_used == 0 and engine.stats().num_running == 0)


def test_disconnect_while_waiting_for_non_streaming_aborts(server: ServerThread, engine: FakeEngine) -> None:
    aborted_before = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CHAT, json={"messages": USER, "max_tokens": 400}, timeout=0.2)
    assert wait_for(lambda: len(engine.aborted) == aborted_before + 1)
    assert wait_for(lambda: engine.stats().num_blocks_used == 0)


def test_queue_full_is_429_with_retry_after_and_abort_while_waiting() -> None:
    engine = FakeEngine(max_num_seqs=1, max_waiting=1, step_delay=0.005)

    async def main(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            body = {"messages": USER, "max_tokens": 300, "stream": True}
            async with c.stream("POST", CHAT, json=body) as running:  # admitted: it streams
                assert running.status_code == 200
                waiting = asyncio.create_task(c.post(CHAT, json={"messages": USER, "max_tokens": 5}))
                assert await asyncio.to_thread(wait_for, lambda: engine.stats().num_waiting == 1)
                r = await c.post(CHAT, json={"messages": USER, "max_tokens": 5})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                waiting.cancel()  # the client gives up while its request is still queued
                assert await asyncio.to_thread(wait_for, lambda: engine.stats().num_waiting == 0)

    with ServerThread(engine) as srv:
        asyncio.run(main(srv.url))
        assert wait_for(lambda: engine.stats().num_running == 0 and len(engine.aborted) == 2)
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=2).choices


def test_engine_error_becomes_error_event_and_503() -> None:
    with ServerThread(FakeEngine(error_after=3)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        events = sse_events(c.post(CHAT, json={"messages": USER, "max_tokens": 10, "stream": True}).text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        r = c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 10})
        assert r.status_code == 503 and "fake engine failure" in r.json()["error"]["message"]
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            list(oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=10, stream=True))


def test_engine_error_on_either_route_streamed_or_not() -> None:
    with ServerThread(FakeEngine(error_after=3)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "x", "n": 2, "echo": True})):
            body = {**body, "max_tokens": 10, "temperature": 0}
            r = c.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
            events = sse_events(c.post(path, json={**body, "stream": True}).text)
            # The stream stops at the first failed choice: one error event, then [DONE].
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
            assert all("error" not in e for e in events[:-2])


class LazyEngine(FakeEngine):
    """An engine whose stream() is an async generator: its errors surface at the first delta."""

    async def stream(self, prompt: Any, params: Any, request_id: str | None = None) -> Any:  # type: ignore[override]
        async for delta in super().stream(prompt, params, request_id):
            yield delta


def test_errors_raised_at_the_first_delta_are_still_4xx() -> None:
    engine = LazyEngine(max_num_seqs=1, max_waiting=1)
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post(COMPLETIONS, json={"prompt": LONG, "max_tokens": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        ok = c.post(CHAT, json={"messages": USER, "max_tokens": 3, "stream": True, "n": 1})
        assert sse_events(ok.text)[-1] == "[DONE]"
        r = c.post(CHAT, json={"messages": USER, "max_tokens": 3, "n": 3})  # 1 runs, 1 waits, 1 is refused
        assert r.status_code == 429
        assert wait_for(lambda: engine.stats().num_running == engine.stats().num_waiting == 0)


def test_dead_engine_is_503() -> None:
    engine = FakeEngine()
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        engine.kill()
        assert c.get("/health").status_code == 503
        r = c.post(CHAT, json={"messages": USER})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


# --- bad input ----------------------------------------------------------------------------------

LONG = "x" * 600
BAD_CHAT = [
    ("{not json", None),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ('[1, 2]', None),
    ("", None),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": USER, "temperature": -0.5}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 2**40}, "max_tokens"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": "2"}, "n"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stop": [1]}, "stop[0]"),
    ({"messages": USER, "seed": 2**70}, "seed"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"messages": USER, "tools": [TOOL, TOOL]}, "tools"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": "maybe"}, "tool_choice"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"-5": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": [1]}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"999": 1}}, "logit_bias"),  # outside the fake vocabulary
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                   {"type": "nonsense"}}}},
     "response_format"),
    ({"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"messages": USER, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
]
BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [400]}, "prompt"),  # outside the fake vocabulary: the engine says so
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "n": 100, "max_tokens": 1, "best_of": 3}, "best_of"),
    ({"prompt": ["x"] * 20, "n": 10}, "n"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids[0]"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": LONG, "max_tokens": 1}, "prompt"),
]


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, str):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize(("path", "body", "param"),
                         [(CHAT, b, p) for b, p in BAD_CHAT] + [(COMPLETIONS, b, p) for b, p in BAD_COMPLETIONS])
def test_bad_requests_are_400_with_param(client: httpx.Client, path: str, body: Any, param: str | None) -> None:
    r = _post(client, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_prompt_longer_than_context_names_both_lengths(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(COMPLETIONS, json={"prompt": LONG, "max_tokens": 1})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and str(len(TOK.encode(LONG))) in message and str(engine.max_model_len) in message


def test_unknown_model_is_404(client: httpx.Client, oai: openai.OpenAI) -> None:
    r = client.post(CHAT, json={"messages": USER, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_unknown_route_and_method_are_error_objects(client: httpx.Client) -> None:
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    r = client.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


# --- other routes -------------------------------------------------------------------------------


def test_models_and_health(client: httpx.Client, oai: openai.OpenAI, engine: FakeEngine) -> None:
    assert [m.id for m in oai.models.list().data] == ["fake-model"]
    card = client.get("/v1/models/fake-model").json()
    assert card["object"] == "model" and card["max_model_len"] == engine.max_model_len
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").status_code == 200


def test_tokenize_detokenize(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert r["tokens"] == TOK.encode("héllo") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len and len(r["token_strs"]) == r["count"]
    no_bos = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert no_bos["tokens"] == TOK.encode("hi", add_bos=False)
    chat = client.post("/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == TOK.encode(TOK.apply_chat_template(USER), add_bos=False)
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
    assert client.post("/detokenize", json={"tokens": [99999]}).json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={}).status_code == 400


# --- metrics ------------------------------------------------------------------------------------

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict reader of the Prometheus text format: TYPE before samples, valid names and values."""
    types: dict[str, str] = {}
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter", "histogram") and name not in types
            types[name] = kind
        elif line.startswith("# HELP "):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, line
            name = m.group(1)
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types, f"sample before its TYPE: {line}"
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.setdefault(name, []).append((labels, float(m.group(3))))
    return samples


def test_metrics(client: httpx.Client, engine: FakeEngine) -> None:
    client.post(CHAT, json={"messages": USER, "max_tokens": 5})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(r.text)
    value = lambda name: m[name][0][1]
    assert m["localbatch:num_requests_running"][0][0] == {"model_name": "fake-model"}
    assert 0 <= value("localbatch:kv_cache_usage_perc") <= 1
    assert value("localbatch:generation_tokens_total") == engine.stats().total_output_tokens > 0
    assert value("localbatch:prompt_tokens_total") > 0
    stats = engine.stats()
    assert value("localbatch:step_time_seconds_total") == stats.total_step_time_s
    assert value("localbatch:step_gap_seconds_total") == stats.total_step_gap_s
    assert value("localbatch:step_gaps_total") == stats.num_step_gaps
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        buckets = [v for _, v in m[f"localbatch:{hist}_bucket"]]
        assert buckets == sorted(buckets) and m[f"localbatch:{hist}_bucket"][-1][0]["le"] == "+Inf"
        assert buckets[-1] == value(f"localbatch:{hist}_count") > 0
    assert any(labels.get("finished_reason") == "length" for labels, _ in m["localbatch:request_success_total"])
    assert not any(math.isnan(v) for series in m.values() for _, v in series)
    assert client.post("/metrics").status_code in (404, 405)  # GET only


def test_metric_labels_are_escaped() -> None:
    from app.engine.types.outputs import EngineStats
    from app.server.prometheus import ServerMetrics

    name = 'we"ird\\name\nx'
    samples = parse_metrics(ServerMetrics().render(EngineStats(), name))
    assert samples["localbatch:num_requests_running"][0][0]["model_name"] == 'we\\"ird\\\\name\\nx'


def test_kv_usage_gauge_is_used_over_total(server: ServerThread, engine: FakeEngine) -> None:
    body = {"messages": USER, "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=server.url, timeout=10) as c, c.stream("POST", CHAT, json=body) as r:
        lines = r.iter_lines()  # dropping this iterator would close the stream
        next(lines)
        usage = parse_metrics(c.get("/metrics").text)["localbatch:kv_cache_usage_perc"][0][1]
        blocks = usage * engine.stats().num_blocks_total  # whole blocks held by the live request
        assert 0 < usage <= 1 and blocks >= 1 and blocks == pytest.approx(round(blocks))
    assert wait_for(lambda: engine.stats().num_blocks_used == 0)


# --- API key and serve() ------------------------------------------------------------------------


def test_api_key_and_served_model_name() -> None:
    with ServerThread(FakeEngine(), api_key="sekrit", served_model_name="alias") as srv:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            body = {"messages": USER, "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                r = c.post(CHAT, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/metrics").status_code == 401
            assert c.get("/health").status_code == 200
            ok = c.post(CHAT, json={**body, "model": "alias"}, headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200 and ok.json()["model"] == "alias"
            other = c.post(CHAT, json={**body, "model": "fake-model"}, headers={"Authorization": "Bearer sekrit"})
            assert other.status_code == 404
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit").models.list().data[0].id == "alias"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_runs_in_the_current_loop_until_cancelled() -> None:
    port = _free_port()

    async def main() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(serve(FakeEngine(), port=port, ready=ready))
        await asyncio.wait_for(ready.wait(), 5)
        async with httpx.AsyncClient(timeout=5) as c:
            assert (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    with socket.create_server(("127.0.0.1", port)):  # the port was released
        pass


def test_serve_refuses_public_host_without_key_and_busy_port() -> None:
    with pytest.raises(ServeError, match="without an API key"):
        asyncio.run(serve(FakeEngine(), host="0.0.0.0", port=0))
    with socket.create_server(("127.0.0.1", 0)) as busy, pytest.raises(ServeError, match="cannot listen"):
        asyncio.run(serve(FakeEngine(), port=busy.getsockname()[1]))


def test_oversized_body_is_rejected_before_reading(server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 99999999999\r\n\r\n{")
        response = b""
        while b'"code"' not in response:
            chunk = s.recv(65536)
            assert chunk, response
            response += chunk
    assert response.startswith(b"HTTP/1.1 413") and b'"invalid_request_error"' in response
