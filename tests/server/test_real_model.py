"""The HTTP server over the real engine and the pulled SmolLM2 chat model: a JSON-schema reply that
parses and validates, a forced tool call whose arguments validate, and a schema the grammar
compiler rejects answered with a 400 while the engine keeps serving. Few and short: a 135M model
on a CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.fake_engine import ServerThread

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "job": {"enum": ["doctor", "teacher", "farmer"]}},
    "required": ["name", "age", "job"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def matches(value: Any, schema: dict[str, Any]) -> bool:
    """The subset of JSON Schema these tests use (jsonschema is not a dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(props)
                and all(matches(value[k], props[k]) for k in value))
    if kind == "integer":
        return isinstance(value, int) and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    from app.engine.api.async_engine import AsyncEngine
    from app.engine.gguf.catalog import installed_path

    if installed_path(MODEL) is None:
        pytest.skip(f"SmolLM2 is not pulled: run `localbatch pull {MODEL}` (the README's test command does)")
    engine = AsyncEngine(model=MODEL, device="cpu", kv_cache_blocks=256)
    try:
        with ServerThread(engine) as server, httpx.Client(base_url=server.url, timeout=300) as c:
            yield c
    finally:
        engine.close()


def test_json_schema_reply_parses_and_validates(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Invent a person."}], "temperature": 0.8, "seed": 7,
            "max_tokens": 60, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "person", "schema": PERSON}}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert matches(json.loads(choice["message"]["content"]), PERSON)


def test_forced_tool_call_validates(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0.8, "seed": 1,
            "max_tokens": 60}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert matches(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_a_schema_the_compiler_rejects_is_a_400_and_the_engine_lives_on(client: httpx.Client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}
    r = client.post("/v1/completions", json={"prompt": "x", "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200
