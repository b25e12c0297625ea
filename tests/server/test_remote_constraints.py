"""The remote client (`--backend-url`) forwards output constraints and logit_bias as OpenAI request
fields, so the TUI's JSON mode works against another server too."""

from __future__ import annotations

import pytest

from app.clients.remote import RemoteEngine
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from tests.support.fake_engine import FakeEngine, ServerThread

USER = [{"role": "user", "content": "hi"}]


def test_the_remote_client_forwards_constraints_and_logit_bias() -> None:
    remote = RemoteEngine("http://gpu-box:8000/v1", "m")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, body = remote._request_body(USER, SamplingParams(json_schema=schema, logit_bias={5: -100}))
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert body["logit_bias"] == {"5": -100}
    _, body = remote._request_body("x", SamplingParams(json_object=True))
    assert body["response_format"] == {"type": "json_object"}
    _, body = remote._request_body("x", SamplingParams(regex="[0-9]+"))
    assert body["structured_outputs"] == {"regex": "[0-9]+"} and "response_format" not in body
    _, body = remote._request_body("x", SamplingParams())
    assert not {"response_format", "logit_bias", "structured_outputs"} & set(body)
    with pytest.raises(RequestError, match="json_schema"):
        remote._request_body("x", SamplingParams(json_schema="{oops"))


async def test_json_mode_through_the_remote_client_end_to_end() -> None:
    engine = FakeEngine()
    with ServerThread(engine) as srv:
        remote = RemoteEngine(srv.url + "/v1", "fake-model")
        try:
            deltas = [d async for d in remote.stream(USER, SamplingParams(json_object=True, max_tokens=50))]
        finally:
            await remote.aclose()
    assert "".join(d.text for d in deltas) == '{"answer": "alpha"}' and deltas[-1].finish_reason == "stop"
    assert engine.submitted[-1].params.json_object is True


async def test_tools_go_through_the_remote_servers_tools_field() -> None:
    """`--backend-url` with tools: the server gets OpenAI `tools`, and its streamed tool_calls come
    back as call text the chat's parser reads."""
    from app.engine.api.tool_use import collect
    from tests.support.fake_engine import ToolTemplateEngine

    call = '<tool_call>{"name": "files__read_file", "arguments": {"path": "a.py"}}</tool_call>'
    engine = ToolTemplateEngine(script=lambda prompt: ["Reading.", call])
    tool = {"type": "function", "function": {"name": "files__read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    with ServerThread(engine) as srv:
        remote = RemoteEngine(srv.url + "/v1", "fake-model")
        try:
            deltas = [d async for d in remote.stream(USER, SamplingParams(max_tokens=200), tools=[tool])]
            auto = engine.submitted[-1].params.structural_tag
            [d async for d in remote.stream(USER, SamplingParams(max_tokens=200), tools=[tool], tool_choice="required")]
        finally:
            await remote.aclose()
    # tool_choice reaches the server: "required" is calls only, "auto" text or calls.
    assert auto["format"]["type"] == "or"
    assert engine.submitted[-1].params.structural_tag["format"]["type"] == "tags_with_separator"
    content, calls = collect("".join(d.text for d in deltas), frozenset({"files__read_file"}))
    assert content == "Reading." and [(c.name, c.arguments) for c in calls] == [("files__read_file", '{"path": "a.py"}')]
    assert engine.submitted[-1].params.structural_tag is not None  # the server constrained the call
