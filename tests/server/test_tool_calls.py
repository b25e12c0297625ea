"""The tool-call parser (streamed and whole forms agree however the text is cut), the structural tags
for each tool_choice (checked against xgrammar itself where it is installed), and the fallback
prompt's rendering of tool turns."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.api.tool_use import (
    CallArguments,
    CallStart,
    Event,
    Text,
    ToolCallParser,
    collect,
    tool_structural_tag,
)
from app.server.openai_schema import ChatMessage
from app.server.output_schema import NamedToolChoice, ToolDefinition
from app.server.tool_prompt import choice_spec, fallback_messages, function_specs, tools_system_prompt

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": {"y": "}"}}}\n</tool_call>'
OUTPUTS = [
    "Hello there",
    CALL,
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"q": [1,2]}}\n</tool_call>\nDone'),
    '<tool_call>{"arguments": {"k": 1}, "name": "z"}</tool_call>',  # keys in the other order
    "<tool_call>not json</tool_call> after",  # not a call: stays text
    "x < y and <tool",  # a partial marker at the end is text
    '<tool_call>\n{"name": "cut", "arguments": {"a": "partial',  # cut by max_tokens
    '<tool_call>\n{"name": "nobrace", "arguments": {"a": 1}\n</tool_call>',  # the call's } forgotten
]
WEATHER = ToolDefinition.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}})
NOARGS = ToolDefinition.model_validate({"type": "function", "function": {"name": "ping"}})


def run(pieces: list[str]) -> tuple[list[Event], ToolCallParser]:
    parser = ToolCallParser()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return events, parser


@settings(max_examples=60, deadline=None)
@given(output=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_streamed_events_join_to_the_whole_result(output: str, cuts: list[int]) -> None:
    pieces, i = [], 0
    for n in cuts * (len(output) // sum(cuts) + 1):
        pieces.append(output[i:i + n])
        i += n
    events, parser = run(pieces)
    content, calls = collect(output)
    streamed = "".join(e.text for e in events if isinstance(e, Text))
    assert (streamed if streamed.strip() or not parser.calls else None) == content
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in calls]
    joined = ["".join(e.text for e in events if isinstance(e, CallArguments) and e.index == k)
              for k in range(len(calls))]
    assert joined == [c.arguments for c in calls]


def test_parsed_calls() -> None:
    content, calls = collect(OUTPUTS[2])
    assert content == "Let me check.\nDone"
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"q": [1,2]}')]
    assert collect(CALL)[0] is None and json.loads(collect(CALL)[1][0].arguments)["x"] == {"y": "}"}
    assert collect(OUTPUTS[3])[1][0].arguments == '{"k": 1}'
    assert collect(OUTPUTS[4]) == (OUTPUTS[4], [])
    assert collect(OUTPUTS[7])[1][0].arguments == '{"a": 1}'


def test_the_name_goes_out_before_the_arguments_are_complete() -> None:
    parser = ToolCallParser()
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in events] == [CallStart, CallArguments]
    assert events[0].name == "get_weather" and events[0].id.startswith("call_") and events[1].text == '{"ci'
    assert parser.feed("ty") == [CallArguments(0, "ty")]
    assert parser.feed('": 1}}\n</tool_') == [CallArguments(0, '": 1')]  # the }s may close the call
    assert parser.feed("call>") == [CallArguments(0, "}")]


def test_text_that_may_open_a_call_is_held_back() -> None:
    parser = ToolCallParser()
    assert parser.feed("Sure <tool") == [Text("Sure")]
    assert parser.feed("box") == [Text(" <toolbox")]
    assert parser.finish() == []


PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>'
TOWN = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}\n</tool_call>'
BARE = '{"name": "get_weather", "arguments": {"city": "x"}}'  # a call object without the tags
BARE_TOWN = '{"name": "get_weather", "arguments": {"town": "x"}}'
BARE_NOPE = '{"name": "shipping_cost", "arguments": {}}'
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "x"\n  }\n}\n```'


@pytest.mark.parametrize(("choice", "parallel", "accepted", "refused"), [
    ("auto", True, ["Sunny.", f"Checking {PING}", PING, f"{PING} done", BARE, f"{BARE}\n", f"Hi {BARE_NOPE}",
                    '{"city": "x"}', '{ "a": 1}', "<b>x</b>", " hi",
                    FENCED, f"```{BARE}```", '```json\n{"city": "x"}\n```', "```python\nx = 1\n```", "`x`",
                    f"Try:\n```json\n{BARE_NOPE}\n```", "{" + BARE + "}", f"{FENCED}\n","```json\n{" + FENCED[8:-4] + "}\n```",
                    '{{"city": "x"}}', "{{ }}", "{{{", "{" + BARE + "}}"],
     [TOWN, BARE_NOPE, f" {BARE_NOPE}", BARE_NOPE.replace('"name"', ' "name"'), BARE_TOWN, f"Hi {TOWN}",
      PING.replace("ping", "pong"), f"```json\n{BARE_NOPE}\n```", FENCED.replace("get_weather", "get_time"),
      FENCED.replace("city", "town"), f"{BARE}\nok", f"{BARE}\n{BARE}", f"{FENCED}\nok", "{" + BARE_NOPE + "}", "{ {" + BARE_TOWN[1:] + "}", "{" + BARE,
      "", " \n"]),  # never an empty reply
    ("required", True, [PING, f"{PING}{PARIS}"], ["Sunny.", f"Hi {PING}", f"{PING}\n"]),
    ("required", False, [PING], [f"{PING}{PING}"]),
    (NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}), True,
     [PARIS], [PING, f"{PARIS}{PARIS}"]),
])
def test_structural_tags_accept_exactly_the_calls_allowed(choice: object, parallel: bool, accepted: list[str],
                                                          refused: list[str]) -> None:
    xgr = pytest.importorskip("xgrammar")
    testing = pytest.importorskip("xgrammar.testing")
    tag = tool_structural_tag(function_specs([WEATHER, NOARGS]), choice_spec(choice), parallel)  # type: ignore[arg-type]
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    for text in accepted:
        assert testing._is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not testing._is_grammar_accept_string(grammar, text), text


def test_tool_choice_none_has_no_tag() -> None:
    assert tool_structural_tag(function_specs([WEATHER]), "none", True) is None


def test_fallback_turns_and_system_prompt() -> None:
    history = [ChatMessage.model_validate(m) for m in [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]]
    turns = fallback_messages(history, [WEATHER], "required")
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "Answer with one or more function calls." in turns[0]["content"]
    assert turns[2]["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                   "\n</tool_call>")
    assert turns[3]["content"] == "<tool_response>\nrain\n</tool_response>"
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    assert "calling the function get_weather" in tools_system_prompt([WEATHER], named)


LOOSE = frozenset({"get_weather"})


def _streamed(text: str, names: frozenset[str], step: int = 1) -> tuple[str, list]:
    parser = ToolCallParser(loose_names=names)
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i:i + step])] + parser.finish()
    return "".join(e.text for e in events if isinstance(e, Text)), [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize("reply", [
    '{{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}',
    '{{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}}',  # a brace too many
    '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "celsius"}\n}\n```',
    '  {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
])
def test_an_untagged_call_to_an_offered_tool_is_a_call(reply):
    """What small models write when they drop the <tool_call> tags (llama.cpp takes these too)."""
    want = [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    content, calls = collect(reply, LOOSE)
    assert content is None and [(c.name, c.arguments) for c in calls] == want
    for step in (1, 3, 1000):
        assert _streamed(reply, LOOSE, step) == ("", want)


@pytest.mark.parametrize("reply", [
    '{"name": "unknown_tool", "arguments": {}}', '```python\nprint("hi")\n```', '{"a": 1}',
    "The weather tool needs a city.", '```json\n{"name": "get_weather", "arguments": {"city": ',
])
def test_other_replies_stay_content(reply):
    content, calls = collect(reply, LOOSE)
    assert calls == [] and content == reply.strip()
    assert _streamed(reply, LOOSE) == (reply.strip(), [])
    assert collect(reply) == (reply.strip(), [])  # no tools offered: never a loose call


@pytest.mark.parametrize(("output", "unclosed", "unclosed_call"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', True, True),  # cut in the arguments
    ('Sure.\n<tool_call>\n{"na', True, False),  # cut before the name: text, no call
    (PING + "\n" + '<tool_call>\n{"name": "get_w', True, False),  # a whole call, then one cut before its name
    ('{"name": "get_weather", "arguments": {"city": "Par', True, False),  # an untagged call object, cut
    (PARIS, False, False),
    ('{"name": "get_weather", "arguments": {"city": "x"}}', False, False),
    ("The weather is fine.", False, False),
])
def test_the_parser_says_when_the_output_ended_inside_a_call(output, unclosed, unclosed_call):
    """What a chat needs to tell a call cut by the token limit from a broken one."""
    for step in (1, 7, 1000):
        parser = ToolCallParser(loose_names=LOOSE)
        for i in range(0, len(output), step):
            parser.feed(output[i:i + step])
        parser.finish()
        assert (parser.unclosed, parser.unclosed_call) == (unclosed, unclosed_call)
        if unclosed_call:
            assert parser.calls[-1].arguments == '{"city": "Par'
