"""response_format, vLLM's structured_outputs / guided_* and logit_bias over HTTP: what reaches the
engine's SamplingParams, what comes back, and the errors (fake engine, which writes a fixed
document valid for the schema it is given)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest

from tests.support.fake_engine import FakeEngine

USER = [{"role": "user", "content": "Describe a person."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=512, step_delay=0.001)


def last_params(engine: FakeEngine) -> Any:
    return engine.submitted[-1].params


def streamed_text(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    text, reason = "", None
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_schema_reaches_the_engine_and_the_reply_validates(client: httpx.Client, engine: FakeEngine,
                                                                 path: str) -> None:
    body = {"messages": USER} if path == CHAT else {"prompt": "A person as JSON:"}
    body = {**body, "response_format": json_schema_format(PERSON), "max_tokens": 200}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    params = last_params(engine)
    assert params.json_schema == PERSON and not params.json_object and params.structural_tag is None
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    person = json.loads(text)
    assert set(person) == {"name", "age", "tags", "address"} and person["tags"][0] in ("a", "b")
    assert choice["finish_reason"] == "stop"
    assert streamed_text(client, path, body) == (text, "stop")


def test_json_object_and_llama_server_schema_spelling(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(CHAT, json={"messages": USER, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and last_params(engine).json_object is True
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = client.post(CHAT, json={"messages": USER, "response_format": {"type": "json_object", "schema": PERSON}})
    assert r.status_code == 200 and last_params(engine).json_schema == PERSON
    # OpenAI's json_schema without a schema: any JSON object.
    r = client.post(CHAT, json={"messages": USER, "response_format": {"type": "json_schema",
                                                                       "json_schema": {"name": "x"}}})
    assert r.status_code == 200 and last_params(engine).json_object is True


def test_text_format_is_unconstrained(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(CHAT, json={"messages": USER, "response_format": {"type": "text"}, "max_tokens": 3})
    params = last_params(engine)
    assert r.status_code == 200 and params.json_schema is None and not params.json_object


@pytest.mark.parametrize(("extra", "field", "value"), [
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"json": PERSON}}, "json_schema", PERSON),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "grammar", 'root ::= "yes" | "no"'),
    ({"guided_regex": "\\d+"}, "regex", "\\d+"),
    ({"guided_json": json.dumps(PERSON)}, "json_schema", json.dumps(PERSON)),
    ({"guided_choice": ['say "hi"']}, "grammar", 'root ::= "say \\"hi\\""'),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}},
     "structural_tag", {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}),
])
def test_vllm_structured_output_fields(client: httpx.Client, engine: FakeEngine, extra: dict[str, Any], field: str,
                                       value: Any) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    assert getattr(last_params(engine), field) == value


def test_max_tokens_cut_is_length_and_need_not_parse(client: httpx.Client) -> None:
    body = {"messages": USER, "response_format": json_schema_format(PERSON), "max_tokens": 3}
    choice = client.post(CHAT, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"]) == 12
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_engine_refuses_is_a_400_naming_response_format(client: httpx.Client, path: str,
                                                                      stream: bool) -> None:
    body = {"messages": USER} if path == CHAT else {"prompt": "x"}
    body = {**body, "stream": stream, "response_format": json_schema_format({"type": "nonsense"})}
    r = client.post(path, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert "nonsense" in error["message"]
    assert client.post(path, json={**body, "response_format": {"type": "json_object"}}).status_code == 200


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": " "}}, "structured_outputs"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
])
def test_constraint_errors_name_the_field_sent(client: httpx.Client, extra: dict[str, Any], param: str) -> None:
    r = client.post(COMPLETIONS, json={"prompt": "x", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logit_bias_reaches_the_engine_with_integer_ids(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": {"5": 10, "7": -100.0}})
    assert r.status_code == 200 and last_params(engine).logit_bias == {5: 10.0, 7: -100.0}
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": {}})
    assert r.status_code == 200 and last_params(engine).logit_bias is None


@pytest.mark.parametrize(("bias", "words"), [
    ({"x": 1}, "'x' is not a token id"), ({"5": 100.5}, "[-100, 100]"), ({"5": True}, "must be a number"),
    ({"999": 1}, "out of range"), ([5], "object mapping token ids")])
def test_bad_logit_bias_is_a_400_saying_why(client: httpx.Client, bias: Any, words: str) -> None:
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "logit_bias": bias})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "logit_bias" and words in error["message"]


def test_openai_sdk_parse_with_a_pydantic_model(oai: openai.OpenAI, engine: FakeEngine) -> None:
    class City(pydantic.BaseModel):
        name: str
        population: int
        districts: list[str]

    completion = oai.chat.completions.parse(model="fake-model", messages=USER, response_format=City)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.population >= 1
    assert last_params(engine).json_schema["properties"]["districts"]["type"] == "array"
