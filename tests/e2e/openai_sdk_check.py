"""Structured output and tool calls of a localbatch server, checked with the official OpenAI SDK.

    python -m tests.e2e.openai_sdk_check                       # starts `localbatch serve` itself
    python -m tests.e2e.openai_sdk_check --base-url http://127.0.0.1:8000/v1   # a running server

Checks (each line prints passed/total; the exit status is 1 if any fails):
- 20 json_schema requests at temperature 0.8, sent concurrently: every reply parses and validates
  (jsonschema) — replies cut by max_tokens are counted as failures;
- the SDK's `chat.completions.parse(response_format=<pydantic model>)`;
- a streamed json_schema reply, joined, validates;
- forced tool calls, named and "required" (10 each): every call names a tool and its arguments
  validate against the tool's parameters; a streamed forced call joins to a valid call;
- tool_choice "auto": 12 questions a tool answers get a valid call, 12 that none fits get a text
  reply (temperature 0.8);
- bad schemas and a bad logit_bias: 400 with OpenAI's error object (message, type, param, code),
  and the server still answers afterwards.

Needs `openai`, `pydantic` and `jsonschema` (the `test` extra). `tests/e2e/test_openai_sdk.py` runs it
under pytest when LOCALBATCH_E2E=1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openai
import pydantic

from app.bench.server import free_port, localbatch_serve_cmd, running

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["doctor", "teacher", "farmer", "engineer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "job", "address", "hobbies", "married"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a date",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "passengers"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
BAD_SCHEMAS = [
    {"type": "nonsense"},
    {"type": "object", "minProperties": "two"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0)
    landmarks: list[str] = pydantic.Field(min_length=1, max_length=3)


@dataclass
class Check:
    name: str
    passed: int = 0
    total: int = 0
    notes: list[str] = field(default_factory=list)

    def record(self, ok: bool, note: str = "") -> None:
        self.total += 1
        self.passed += ok
        if not ok and note and len(self.notes) < 3:
            self.notes.append(note)

    def line(self) -> str:
        mark = "ok  " if self.passed == self.total and self.total else "FAIL"
        notes = "".join(f"\n        {n}" for n in self.notes)
        return f"{mark} {self.passed:>3}/{self.total:<3} {self.name}{notes}"


def valid(instance: Any, schema: dict[str, Any]) -> str | None:
    """None when `instance` validates, else why not."""
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as exc:
        return exc.message
    return None


def check_json(text: str | None, reason: str | None, schema: dict[str, Any]) -> tuple[bool, str]:
    if reason != "stop":
        return False, f"finish_reason {reason!r}: {text!r:.120}"
    try:
        why = valid(json.loads(text or ""), schema)
    except ValueError as exc:
        return False, f"not JSON ({exc}): {text!r:.120}"
    return why is None, f"{why}: {text!r:.120}"


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def record_concurrently(check: Check, one: Callable[[int], tuple[bool, str]], count: int) -> Check:
    """Run `one(0..count-1)` as concurrent requests and record each outcome in `check`."""
    with ThreadPoolExecutor(count) as pool:
        for ok, note in pool.map(one, range(count)):
            check.record(ok, note)
    return check


def schema_requests(client: openai.OpenAI, model: str, count: int) -> Check:
    check = Check(f"json_schema at temperature 0.8 ({count} concurrent requests)")

    def one(i: int) -> tuple[bool, str]:
        reply = client.chat.completions.create(
            model=model, temperature=0.8, max_tokens=300, response_format=json_schema_format(PERSON),  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}])
        return check_json(reply.choices[0].message.content, reply.choices[0].finish_reason, PERSON)

    return record_concurrently(check, one, count)


def sdk_parse(client: openai.OpenAI, model: str) -> Check:
    check = Check("chat.completions.parse(response_format=<pydantic model>)")
    parse: Callable[..., Any] = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for i in range(3):
        completion = parse(model=model, temperature=0.8, max_tokens=200, response_format=City,
                           messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}])
        parsed = completion.choices[0].message.parsed
        check.record(isinstance(parsed, City), f"{completion.choices[0].message.content!r:.120}")
    return check


def streamed_schema(client: openai.OpenAI, model: str) -> Check:
    check = Check("streamed json_schema reply, joined")
    stream = client.chat.completions.create(
        model=model, temperature=0.8, max_tokens=300, response_format=json_schema_format(PERSON), stream=True,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Invent a person as JSON."}])
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    check.record(*check_json(text, reason, PERSON))
    return check


def check_calls(message: Any, reason: str | None, allowed: set[str]) -> tuple[bool, str]:
    calls = message.tool_calls or []
    if reason != "tool_calls" or not calls:
        return False, f"finish_reason {reason!r}, {len(calls)} calls, content {message.content!r:.100}"
    for call in calls:
        if call.function.name not in allowed or not call.id.startswith("call_"):
            return False, f"unexpected call {call.function.name!r} ({call.id})"
        try:
            why = valid(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        except ValueError as exc:
            why = f"arguments are not JSON ({exc})"
        if why is not None:
            return False, f"{call.function.name}: {why}: {call.function.arguments!r:.100}"
    return True, ""


def forced_calls(client: openai.OpenAI, model: str, choice: Any, count: int) -> Check:
    label = choice if isinstance(choice, str) else f"named {choice['function']['name']}"
    check = Check(f"forced tool calls, tool_choice {label} ({count} concurrent requests)")
    allowed = set(PARAMETERS) if isinstance(choice, str) else {choice["function"]["name"]}
    questions = ["What's the weather in Oslo?", "Find flights from JFK to LHR for two people.",
                 "Is it raining in Lima right now?", "I need a flight from CDG to NRT for 3 passengers."]

    def one(i: int) -> tuple[bool, str]:
        reply = client.chat.completions.create(
            model=model, temperature=0.8, max_tokens=200, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": questions[i % len(questions)]}])
        return check_calls(reply.choices[0].message, reply.choices[0].finish_reason, allowed)

    return record_concurrently(check, one, count)


FITS_A_TOOL = [
    "What's the weather like in Paris right now, in celsius?", "Is it cold in Toronto today? Use fahrenheit.",
    "How warm is it in Madrid at the moment (celsius)?", "Tell me the current temperature in Tokyo in celsius.",
    "Should I take an umbrella in London today? Check the weather in celsius.",
    "Weather in Chicago in fahrenheit, please.", "Find me flights from SFO to JFK for one passenger.",
    "Book-search: flights from LHR to CDG for 2 people.", "Are there flights from BOS to MIA for four passengers?",
    "Look up flights from SEA to LAX for 3 travellers.", "I want to fly from ORD to DEN with my wife: search flights.",
    "Search flights from AMS to BCN for 1 passenger.",
]
FITS_NO_TOOL = [
    "Write a Python function that reverses a string.", "What is the capital of Italy?",
    "Explain what a hash map is in two sentences.", "Write a haiku about autumn.",
    "What does the `yield` keyword do in Python?", "Translate 'good morning' into Spanish.",
    "How many sides does a hexagon have?", "Give me three tips for writing clean code.",
    "What is 17 times 23?", "Who wrote the novel 'Pride and Prejudice'?",
    "Fix this code: `print('hello'`", "Summarize what a binary search does.",
]


def auto_calls(client: openai.OpenAI, model: str) -> tuple[Check, Check]:
    """tool_choice "auto": a call where a tool fits, text where none does."""
    fits = Check(f"tool_choice auto, a tool fits: called ({len(FITS_A_TOOL)} questions)")
    none = Check(f"tool_choice auto, no tool fits: answered in text ({len(FITS_NO_TOOL)} questions)")

    def ask(question: str) -> Any:
        return client.chat.completions.create(model=model, temperature=0.8, max_tokens=160, tools=TOOLS,
                                              tool_choice="auto", messages=[{"role": "user", "content": question}])

    with ThreadPoolExecutor(max_workers=8) as pool:
        for question, reply in zip(FITS_A_TOOL, pool.map(ask, FITS_A_TOOL)):
            ok, why = check_calls(reply.choices[0].message, reply.choices[0].finish_reason, set(PARAMETERS))
            fits.record(ok, f"{question!r}: {why}")
        for question, reply in zip(FITS_NO_TOOL, pool.map(ask, FITS_NO_TOOL)):
            message = reply.choices[0].message
            fits_none = not message.tool_calls and bool((message.content or "").strip())
            none.record(fits_none, f"{question!r}: {len(message.tool_calls or [])} calls, {message.content!r:.80}")
    return fits, none


def streamed_call(client: openai.OpenAI, model: str) -> Check:
    check = Check("streamed forced tool call, joined")
    stream = client.chat.completions.create(
        model=model, temperature=0.8, max_tokens=200, tools=TOOLS, tool_choice="required", stream=True,  # type: ignore[arg-type]
        parallel_tool_calls=False, messages=[{"role": "user", "content": "Weather in Rome, in celsius?"}])
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for piece in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    message = openai.types.chat.ChatCompletionMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]})
    check.record(*check_calls(message, reason, set(PARAMETERS)))
    return check


def bad_requests(client: openai.OpenAI, model: str) -> Check:
    check = Check("bad schemas and logit_bias: 400 with an OpenAI error object; server still answers")
    requests: list[dict[str, Any]] = [{"response_format": json_schema_format(s)} for s in BAD_SCHEMAS]
    requests.append({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                     "tool_choice": "required"})
    requests.append({"logit_bias": {"99999999": 5}})
    for extra in requests:
        try:
            client.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                           **extra)
        except openai.BadRequestError as exc:
            error = (exc.body or {}) if isinstance(exc.body, dict) else {}
            ok = exc.status_code == 400 and {"message", "type", "param", "code"} <= set(error) and bool(error["param"])
            check.record(ok, f"{exc.status_code} {error}")
        except openai.APIError as exc:
            check.record(False, f"{type(exc).__name__}: {exc}")
        else:
            check.record(False, f"accepted: {extra}")
    alive = client.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    check.record(bool(alive.choices), "no answer after the bad requests")
    return check


@contextlib.contextmanager
def local_server(model: str, extra: list[str]) -> Iterator[str]:
    """`localbatch serve` on a free loopback port, until the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(localbatch_serve_cmd(["--model", model, *extra], port), url):
        yield f"{url}/v1"


def run(base_url: str, count: int) -> list[Check]:
    """Every check against the server at `base_url` (…/v1), each line printed as it ends."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    print(f"server {base_url}, model {model}")
    checks = [
        lambda: schema_requests(client, model, count),
        lambda: sdk_parse(client, model),
        lambda: streamed_schema(client, model),
        lambda: forced_calls(client, model, {"type": "function", "function": {"name": "get_weather"}}, count // 2),
        lambda: forced_calls(client, model, "required", count // 2),
        lambda: streamed_call(client, model),
        lambda: auto_calls(client, model),
        lambda: bad_requests(client, model),
    ]
    done: list[Check] = []
    for make in checks:
        start = time.perf_counter()
        made = make()
        for check in made if isinstance(made, tuple) else (made,):
            print(f"{check.line()}  ({time.perf_counter() - start:.1f} s)", flush=True)
            done.append(check)
    return done


def all_passed(checks: list[Check]) -> bool:
    return all(c.passed == c.total for c in checks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server (…/v1); default: start `localbatch serve`")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model to serve when starting the server")
    p.add_argument("--count", type=int, default=20, help="json_schema requests (forced calls: half as many of each)")
    p.add_argument("serve_args", nargs="*", help="extra `localbatch serve` flags (after --)")
    args = p.parse_args()
    if args.base_url:
        return 0 if all_passed(run(args.base_url, args.count)) else 1
    with local_server(args.model, args.serve_args) as url:
        return 0 if all_passed(run(url, args.count)) else 1


if __name__ == "__main__":
    sys.exit(main())
