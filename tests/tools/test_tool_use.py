"""`tool_request` without a model: the constraint added to the caller's params (a JSON answer can
stand beside calls, other constraints cannot), the native and the fallback prompt."""

from __future__ import annotations

import pytest

from app.engine.api.tool_use import FunctionSpec, NamedChoice, tool_request
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from app.tools.approval import REFUSED_TEXT
from app.tools.guidance import CANCELLED_TEXT, cut_call_cause, next_tool_choice

TOOL = {"type": "function", "function": {"name": "files__read_file", "description": "Read a file.",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


class Plain:
    """An engine whose template knows no tools (the fallback)."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [1] * add_bos + [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


class Native(Plain):
    """An engine whose template renders tools as Qwen's does."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None) -> str:
        names = " ".join(t["function"]["name"] for t in tools or [])
        return f"<tools>{names}</tools> use <tool_call>" + super().apply_chat_template(messages)


MESSAGES = [{"role": "user", "content": "read a.py"}]


def test_fallback_prompt_and_constraint() -> None:
    request = tool_request(Plain(), MESSAGES, [TOOL], SamplingParams(max_tokens=8))
    assert isinstance(request.prompt, list) and request.prompt[0]["role"] == "system"
    assert '"name": "files__read_file"' in request.prompt[0]["content"]
    fmt = request.params.structural_tag["format"]
    free = fmt["elements"][-1]["elements"][-1]  # "auto": the branch of a reply that opens with text
    assert free["type"] == "triggered_tags" and free["tags"][0]["content"]["json_schema"] == TOOL["function"]["parameters"]
    assert request.params.max_tokens == 8 and request.tool_names == {"files__read_file"}
    assert request.parser().loose_names == {"files__read_file"}


def test_native_prompt_is_token_ids() -> None:
    request = tool_request(Native(), MESSAGES, [FunctionSpec.from_openai(TOOL)], SamplingParams())
    assert request.prompt[0] == 1 and "".join(map(chr, request.prompt[1:])).startswith("<tools>files__read_file")


def test_choices_and_other_constraints() -> None:
    named = tool_request(Plain(), MESSAGES, [TOOL], SamplingParams(), choice=NamedChoice("files__read_file"))
    assert named.params.structural_tag["format"]["stop_after_first"] is True
    none = tool_request(Plain(), MESSAGES, [TOOL], SamplingParams(), choice="none")
    assert none.params.structural_tag is None and none.prompt == MESSAGES
    json_answer = tool_request(Plain(), MESSAGES, [TOOL], SamplingParams(json_object=True))
    assert json_answer.params.structural_tag["format"]["type"] == "or" and not json_answer.params.json_object
    with pytest.raises(RequestError, match="regex cannot be combined with tools"):
        tool_request(Plain(), MESSAGES, [TOOL], SamplingParams(regex="a+"))


def test_a_failed_round_is_followed_by_a_call_once() -> None:
    def rnd(*contents: str) -> list[dict]:
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                 for i in range(len(contents))]
        return [{"role": "assistant", "content": "", "tool_calls": calls}] + [
            {"role": "tool", "tool_call_id": f"c{i}", "content": c} for i, c in enumerate(contents)]

    user = [{"role": "user", "content": "What is TAX_RATE?"}]
    missing = "Error executing tool read_file: 'config.py' does not exist"
    assert next_tool_choice(user) == "auto"
    assert next_tool_choice(user + rnd(missing)) == "required"
    assert next_tool_choice(user + rnd(missing, "TAX_RATE = 0.2")) == "auto"  # one call of the round worked
    assert next_tool_choice(user + rnd("ok") + rnd(missing)) == "required"
    assert next_tool_choice(user + rnd(missing) + rnd(missing)) == "auto"  # once per streak
    assert next_tool_choice(user + rnd(missing) + rnd(missing) + rnd("ok") + rnd(missing)) == "required"
    assert next_tool_choice(user + rnd(REFUSED_TEXT)) == "auto"  # the user said no
    assert next_tool_choice(user + rnd(CANCELLED_TEXT)) == "auto"
    assert next_tool_choice(user + rnd(f"Error: {cut_call_cause(4)}; write a shorter call")) == "auto"
    assert next_tool_choice(user + rnd(missing) + [{"role": "assistant", "content": "It is missing."},
                                                   {"role": "user", "content": "Look again"}]) == "auto"
