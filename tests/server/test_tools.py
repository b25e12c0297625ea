"""tools / tool_choice over HTTP with the fake engine: the prompt the engine gets (fallback system
prompt, or the template's own tool support), the structural tag constraining the output, and the
calls parsed back into OpenAI's `message.tool_calls` and streamed `delta.tool_calls`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_engine import (
    FakeEngine,
    FakeTokenizer,
    ServerThread,
    ToolTemplateEngine,
)

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def auto_reply(_: Any) -> list[str]:
    """A model that says something, then calls get_time, in pieces that split the markers."""
    text = "Let me check. " + CALL
    return [text[i:i + 3] for i in range(0, len(text), 3)]


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096, num_blocks=1024, step_delay=0.001)


def stream_events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def assemble(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """content, tool calls and finish reason, joined the way OpenAI's clients join deltas."""
    content, calls, reason = "", [], None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            if piece["index"] == len(calls):
                calls.append({"id": piece["id"], "type": piece["type"],
                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments", "")
        reason = choice["finish_reason"] or reason
    return content, calls, reason


def tag_format(engine: FakeEngine) -> dict[str, Any]:
    return engine.submitted[-1].params.structural_tag["format"]


# --- what the engine is asked ---------------------------------------------------------------------


def test_fallback_prompt_lists_the_tools_in_a_system_turn(client: httpx.Client, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    assert client.post(CHAT, json={"messages": messages, "tools": TOOLS, "max_tokens": 2}).status_code == 200
    sent = engine.submitted[-1].prompt
    assert [m["role"] for m in sent] == ["system", "user"]
    system = sent[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(WEATHER) in system and "<tool_call>" in system


@pytest.mark.parametrize(("choice", "kind", "names", "at_least_one", "one_call"), [
    ("auto", "triggered_tags", ["get_weather", "get_time"], False, False),
    (None, "triggered_tags", ["get_weather", "get_time"], False, False),
    ("required", "tags_with_separator", ["get_weather", "get_time"], True, False),
    ({"type": "function", "function": {"name": "get_time"}}, "tags_with_separator", ["get_time"], True, True),
])
def test_tool_choice_becomes_a_structural_tag(client: httpx.Client, engine: FakeEngine, choice: Any, kind: str,
                                              names: list[str], at_least_one: bool, one_call: bool) -> None:
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 2}
    r = client.post(CHAT, json=body if choice is None else {**body, "tool_choice": choice})
    assert r.status_code == 200, r.text
    fmt = tag_format(engine)
    if kind == "triggered_tags":  # "auto": a branch per opening; the text's is triggered_tags
        assert fmt["type"] == "or"
        fmt = fmt["elements"][-1]["elements"][-1]  # the text branch, the last (no empty reply)
    assert fmt["type"] == kind and fmt["at_least_one"] is at_least_one and fmt["stop_after_first"] is one_call
    assert [t["begin"] for t in fmt["tags"]] == [f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in names]
    schemas = {t["begin"]: t["content"]["json_schema"] for t in fmt["tags"]}
    assert WEATHER["function"]["parameters"] in schemas.values() or names == ["get_time"]


def test_tool_choice_none_offers_no_tools(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(CHAT, json={"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200 and engine.submitted[-1].params.structural_tag is None
    assert engine.submitted[-1].prompt == USER


def test_parallel_tool_calls_false_stops_after_the_first(client: httpx.Client, engine: FakeEngine) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    assert client.post(CHAT, json=body).status_code == 200 and tag_format(engine)["stop_after_first"] is True


def test_json_response_format_next_to_auto_tools_is_either(client: httpx.Client, engine: FakeEngine) -> None:
    body = {"messages": USER, "tools": TOOLS, "response_format": {"type": "json_object"}, "max_tokens": 2}
    assert client.post(CHAT, json=body).status_code == 200
    calls, answer = tag_format(engine)["elements"]
    assert calls["at_least_one"] is True and answer == {"type": "json_schema", "json_schema": {"type": "object"}}
    # A forced call is this turn's output; the format applies to a later answer.
    assert client.post(CHAT, json={**body, "tool_choice": "required"}).status_code == 200
    assert tag_format(engine)["type"] == "tags_with_separator"
    r = client.post(CHAT, json={**body, "response_format": None, "guided_regex": "a+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_bad_parameters_schema_is_a_400_naming_tools(client: httpx.Client) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    r = client.post(CHAT, json={"messages": USER, "tools": [bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# --- calls in the response ------------------------------------------------------------------------


def test_required_call_parses_into_tool_calls(client: httpx.Client) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    choice = client.post(CHAT, json=body).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "alpha", "unit": "celsius"}


def test_streamed_tool_calls_join_to_the_whole_response(client: httpx.Client) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    chunks = stream_events(client, body)
    content, calls, reason = assemble(chunks)
    whole = client.post(CHAT, json=body).json()["choices"][0]["message"]
    assert content == "" and reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    firsts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert firsts[0]["function"] == {"name": "get_time", "arguments": ""} and "id" in firsts[0]
    assert all(set(f) == {"index", "function"} for f in firsts[1:])  # later pieces: arguments only
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_text_then_call_with_markers_split_across_tokens(stream: bool) -> None:
    engine = FakeEngine(script=auto_reply, max_model_len=2048, num_blocks=1024)
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"messages": USER, "tools": TOOLS}
        if stream:
            chunks = stream_events(c, body)
            content, calls, reason = assemble(chunks)
            assert not any("<" in (ch["choices"][0]["delta"].get("content") or "") for ch in chunks)
        else:
            choice = c.post(CHAT, json=body).json()["choices"][0]
            content, calls, reason = choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
    assert content == "Let me check." and reason == "tool_calls"
    assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [("get_time", {"zone": "CET"})]


def test_auto_without_a_call_is_plain_content(client: httpx.Client) -> None:
    choice = client.post(CHAT, json={"messages": USER, "tools": TOOLS, "max_tokens": 6}).json()["choices"][0]
    assert choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_openai_sdk_round_trip_with_tool_results(oai: openai.OpenAI, engine: FakeEngine) -> None:
    first = oai.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, tool_choice="required")
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*USER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
               {"role": "tool", "tool_call_id": "call_other", "content": "second result"}]
    second = oai.chat.completions.create(model="fake-model", messages=history, tools=TOOLS, max_tokens=3)
    assert second.choices[0].finish_reason == "length"
    sent = engine.submitted[-1].prompt
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": ' \
                                 '{"city": "alpha", "unit": "celsius"}}\n</tool_call>'
    assert sent[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>\n' \
                                 '<tool_response>\nsecond result\n</tool_response>'


def test_openai_sdk_streaming_tool_calls(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, tool_choice="required",
                                         stream=True)
    names, arguments, reasons = [], "", []
    for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or []:
            names += [piece.function.name] if piece.function.name else []
            arguments += piece.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert names == ["get_weather"] and json.loads(arguments)["unit"] == "celsius" and reasons == ["tool_calls"]


def test_tool_history_without_tools_still_renders() -> None:
    engine = FakeEngine()
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.post(CHAT, json={"messages": history, "max_tokens": 2}).status_code == 200
        tokens = c.post("/tokenize", json={"messages": history}).json()["tokens"]
    assert [m["role"] for m in engine.submitted[-1].prompt] == ["user", "assistant", "user"]
    assert "<tool_response>\n12:00\n</tool_response>" in FakeTokenizer().decode(tokens)


def test_a_template_with_tool_support_renders_the_tools_itself() -> None:
    engine = ToolTemplateEngine(max_model_len=2048, num_blocks=1024)
    history = [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post(CHAT, json={"messages": history, "tools": TOOLS, "tool_choice": "required"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    prompt = engine.submitted[-1].prompt
    text = FakeTokenizer().decode(prompt)  # token ids: the server rendered the template
    assert prompt[0] == FakeTokenizer.BOS and prompt.count(FakeTokenizer.BOS) == 1
    assert text.startswith("<system>tools: get_weather, get_time;") and "<tool>12:00" in text
