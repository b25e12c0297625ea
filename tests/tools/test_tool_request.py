"""`tool_request` with the real SmolLM2 (its template has no tools: the fallback prompt): a call the
model must make parses and its arguments validate against the built-in read_file schema; the
call and its result, sent back, render as the next turn's prompt. Short: a 135M model on a CPU."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import jsonschema
import pytest

from app.engine.api.tool_use import CallStart, Text, tool_request
from app.engine.types.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
READ_FILE = {"type": "function", "function": {
    "name": "files__read_file", "description": "Read a text file, or a range of its lines.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 40, "description": "file relative to the working directory"},
        "start_line": {"type": "integer", "minimum": 1}},
        "required": ["path"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "files__search", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string", "maxLength": 30}}, "required": ["pattern"]}}}


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from app.engine.api.async_engine import AsyncEngine
    from app.engine.gguf.catalog import installed_path

    if installed_path(MODEL) is None:
        pytest.skip(f"SmolLM2 is not pulled: run `localbatch pull {MODEL}`")
    engine = AsyncEngine(model=MODEL, device="cpu", kv_cache_blocks=128)
    yield engine
    engine.close()


async def _reply(engine, request) -> tuple[str, list]:
    parser = request.parser()
    events = []
    async for delta in engine.stream(request.prompt, request.params):
        events += parser.feed(delta.text)
    events += parser.finish()
    return "".join(e.text for e in events if isinstance(e, Text)), [e for e in events if isinstance(e, CallStart)], \
        parser.calls


def test_required_call_parses_and_validates(engine) -> None:
    messages = [{"role": "user", "content": "Show me the file setup.py"}]
    request = tool_request(engine, messages, [READ_FILE, SEARCH], SamplingParams(max_tokens=48, temperature=0.0),
                           choice="required", parallel=False)
    assert request.params.structural_tag is not None and request.tool_names == {"files__read_file", "files__search"}
    _, starts, calls = asyncio.run(_reply(engine, request))
    assert len(calls) == 1 and starts[0].name == calls[0].name
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (READ_FILE, SEARCH)}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), schema)

    # The round trip: the call and its result go back into the conversation.
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [calls[0].openai()]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "setup.py: lines 1-1 of 1\nimport os\n"}]
    follow = tool_request(engine, history, [READ_FILE, SEARCH], SamplingParams(max_tokens=8, temperature=0.0))
    rendered = json.dumps(follow.prompt)
    assert "<tool_response>\\nsetup.py: lines 1-1 of 1\\nimport os\\n\\n</tool_response>" in rendered
    assert f'"name": "{calls[0].name}"' in rendered.replace('\\"', '"')
    asyncio.run(_reply(engine, follow))  # runs: the free-text "auto" turn is accepted by the engine
