"""Tools in a chat, for every caller of the engine (the HTTP endpoint, the app's chat tabs): the
prompt of a conversation with tools or tool history, the constraint that makes a call name an
offered tool with arguments valid for its schema, and the parser of the reply. Messages are
OpenAI-style dicts (`role`, `content`, `tool_calls`, `tool_call_id`, `name`).

Where the engine's chat template takes `tools` and writes them as Hermes/Qwen-style
`<tool_call>` instructions (it mentions every tool and `<tool_call>`), the template renders the
tools, the assistant turns' `tool_calls` and the `tool` turns itself; the rendered text goes to
the engine as token ids.

Otherwise (a template without tool support, such as SmolLM2's), the fallback: a system prompt
lists the tools' JSON signatures and asks for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks; past calls are written back into their assistant turns in that form and
tool results become user turns of `<tool_response>...</tool_response>` blocks, so any template
that renders system/user/assistant renders the conversation.

`tool_request` is the one call a chat makes: the prompt, the sampling params with the call
constraint, and a parser for the reply."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.structured.tool_grammar import tool_structural_tag
from app.engine.text.tool_calls import (
    CALL_OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    CallArguments,
    CallStart,
    Event,
    FunctionSpec,
    NamedChoice,
    ParsedCall,
    Text,
    ToolCallParser,
    ToolChoiceSpec,
    call_text,
    collect,
    new_call_id,
)
from app.engine.types.errors import LocalbatchError, RequestError
from app.engine.types.sampling_params import SamplingParams

__all__ = [
    "CallArguments", "CallStart", "Event", "FunctionSpec", "NamedChoice", "ParsedCall", "Text", "ToolCallParser",
    "ToolChoiceSpec", "ToolRequest", "arguments_object", "call_text", "chat_prompt", "collect", "encode_rendered",
    "fallback_messages", "new_call_id", "tool_request", "tool_structural_tag", "tools_system_prompt",
]

Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """What a chat sends for one model turn with tools offered."""

    prompt: Prompt  # token ids (the template rendered the tools) or plain chat messages (the fallback)
    params: SamplingParams  # the caller's params with the tool-call constraint added
    tool_names: frozenset[str]

    def parser(self) -> ToolCallParser:
        """A parser for this turn's reply: feed it the streamed text, `finish()` at the end."""
        return ToolCallParser(loose_names=self.tool_names)


def tool_request(engine: EngineClient, messages: Sequence[Message], tools: Sequence[FunctionSpec | Mapping[str, Any]],
                 params: SamplingParams, choice: ToolChoiceSpec = "auto", parallel: bool = True) -> ToolRequest:
    """The prompt and the constrained params of a turn offering `tools` (OpenAI `tools` entries or
    `FunctionSpec`s). Under "auto" the model writes free text or calls; a call names one of the
    tools and its arguments validate against that tool's schema. A JSON schema in `params` stays
    the constraint of a plain answer; other constraints cannot be combined with tools."""
    specs = [t if isinstance(t, FunctionSpec) else FunctionSpec.from_openai(dict(t)) for t in tools]
    offered = specs if choice != "none" else []
    prompt = chat_prompt(engine, messages, offered, choice)
    tag = tool_structural_tag(offered, choice, parallel, _answer_schema(params) if offered else None)
    if tag is not None:
        constraints = {name: None for name in ("json_schema", "regex", "grammar")}
        params = dataclasses.replace(params, **constraints, json_object=False, structural_tag=tag)
    return ToolRequest(prompt, params, frozenset(t.name for t in offered))


def _answer_schema(params: SamplingParams) -> dict[str, Any] | None:
    if params.json_object:
        return {"type": "object"}
    if params.json_schema is not None:
        return params.json_schema if isinstance(params.json_schema, dict) else json.loads(params.json_schema)
    if params.constraint_field is not None:
        raise RequestError(f"{params.constraint_field} cannot be combined with tools; only a JSON schema can",
                           param=params.constraint_field)
    return None


def chat_prompt(engine: EngineClient, messages: Sequence[Message], tools: Sequence[FunctionSpec],
                choice: ToolChoiceSpec) -> Prompt:
    """What the engine is given for this conversation: chat messages, or token ids of a
    conversation the template rendered with its own tool support. `tools` are those offered
    (none when `choice` is "none")."""
    offered = list(tools) if choice != "none" else []
    if offered or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        rendered = _native_render(engine, messages, offered)
        if rendered is not None:
            return encode_rendered(engine, rendered)
    return fallback_messages(messages, offered, choice)


# --- the model's own template -------------------------------------------------------------------


def _native_render(engine: EngineClient, messages: Sequence[Message], tools: list[FunctionSpec]) -> str | None:
    """The template's rendering with `tools`, when it takes them and writes `<tool_call>` calls."""
    render: Callable[..., str] = engine.apply_chat_template
    if "tools" not in _parameters(render):
        return None
    specs = [t.openai() for t in tools] or None
    try:
        text = render([_native_message(m) for m in messages], add_generation_prompt=True, tools=specs)
    except (LocalbatchError, ValueError):
        return None  # e.g. a template that refuses "tool" turns: the fallback rewrites them
    if tools and (CALL_OPEN not in text or any(t.name not in text for t in tools)):
        return None  # the template ignored the tools or asks for another call format
    if not tools and RESPONSE_OPEN not in text and any(m.get("role") == "tool" for m in messages):
        return None
    return text


def _parameters(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()


def _plain(message: Message) -> dict[str, str]:
    # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
    role = "system" if message.get("role") == "developer" else message.get("role", "user")
    return {"role": role, "content": message.get("content") or ""}


def _native_message(message: Message) -> dict[str, Any]:
    """Hugging Face's conversation shape: tool-call arguments as objects, as templates index them."""
    out: dict[str, Any] = _plain(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": arguments_object(c)}}
                             for c in message["tool_calls"]]
    if message.get("role") == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    if message.get("name"):
        out["name"] = message["name"]
    return out


def encode_rendered(engine: EngineClient, text: str) -> list[int]:
    """Token ids of rendered chat text with exactly one BOS, as the engine encodes conversations."""
    bos = engine.encode("", add_bos=True)
    ids = engine.encode(text, add_bos=False)
    return ids if not bos or ids[:len(bos)] == bos else [*bos, *ids]


def arguments_object(call: Mapping[str, Any]) -> Any:
    """A past call's arguments as a JSON value (clients send a JSON string; a broken one stays text)."""
    args = call["function"].get("arguments")
    if not isinstance(args, str):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args


# --- the fallback ---------------------------------------------------------------------------------


def fallback_messages(messages: Sequence[Message], tools: Sequence[FunctionSpec],
                      choice: ToolChoiceSpec) -> list[dict[str, str]]:
    """The conversation in plain system/user/assistant turns, with the tools in the system prompt."""
    out: list[dict[str, str]] = []
    previous: Message | None = None
    for message in messages:
        if message.get("role") == "tool":
            block = f"{RESPONSE_OPEN}\n{message.get('content') or ''}\n{RESPONSE_CLOSE}"
            if previous is not None and previous.get("role") == "tool":
                out[-1]["content"] += "\n" + block  # the results of one turn's calls share a user turn
            else:
                out.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], arguments_object(c)) for c in message["tool_calls"])
            content = f"{message['content']}\n{calls}" if message.get("content") else calls
            out.append({"role": "assistant", "content": content})
        else:
            out.append(_plain(message))
        previous = message
    if tools:
        _add_system_prompt(out, tools_system_prompt(tools, choice))
    return out


def tools_system_prompt(tools: Sequence[FunctionSpec], choice: ToolChoiceSpec) -> str:
    """The fallback's instructions: the signatures, the call format, and what `choice` demands."""
    signatures = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    example = call_text("function_name", {"argument": "value"})
    if choice == "required":
        rule = "Answer with one or more function calls."
    elif isinstance(choice, NamedChoice):
        rule = f"Answer by calling the function {choice.name}."
    else:
        rule = "Call a function when it helps answer; otherwise answer in plain text."
    return ("# Tools\n\nYou have access to these functions, described as JSON:\n<tools>\n"
            f"{signatures}\n</tools>\n\nTo call a function, write a block like this for each call, "
            f"with arguments that match its parameters:\n{example}\n"
            f"The results come back in {RESPONSE_OPEN} blocks. {rule}")


def _add_system_prompt(turns: list[dict[str, str]], text: str) -> None:
    if turns and turns[0]["role"] == "system":
        turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}
    else:
        turns.insert(0, {"role": "system", "content": text})
