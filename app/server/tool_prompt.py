"""The prompt of a chat request with tools or tool history.

Where the engine's chat template takes `tools` and writes them as Hermes/Qwen-style
`<tool_call>` instructions (it mentions every tool and `<tool_call>`), the template renders the
tools, the assistant turns' `tool_calls` and the `tool` turns itself; the rendered text goes to
the engine as token ids.

Otherwise (a template without tool support, such as SmolLM2's), the fallback: a system prompt
lists the tools' JSON signatures and asks for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks; past calls are written back into their assistant turns in that form and
tool results become user turns of `<tool_response>...</tool_response>` blocks, so any template
that renders system/user/assistant renders the conversation."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.types.errors import LocalbatchError
from app.server.openai_schema import ChatMessage, ToolCall
from app.server.output_schema import ToolChoice, ToolDefinition
from app.server.tool_grammar import CALL_CLOSE, CALL_OPEN

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], tools: list[ToolDefinition],
                choice: ToolChoice) -> Prompt:
    """What the engine is given for this conversation: chat messages, or token ids of a
    conversation the template rendered with its own tool support. `tools` are those offered
    (none when `choice` is "none")."""
    offered = tools if choice != "none" else []
    if offered or any(m.role == "tool" or m.tool_calls for m in messages):
        rendered = _native_render(engine, messages, offered)
        if rendered is not None:
            return encode_rendered(engine, rendered)
    return fallback_messages(messages, offered, choice)


# --- the model's own template -------------------------------------------------------------------


def _native_render(engine: EngineClient, messages: list[ChatMessage], tools: list[ToolDefinition]) -> str | None:
    """The template's rendering with `tools`, when it takes them and writes `<tool_call>` calls."""
    render: Callable[..., str] = engine.apply_chat_template
    if "tools" not in _parameters(render):
        return None
    specs = [t.model_dump(exclude_none=True) for t in tools] or None
    try:
        text = render([_native_message(m) for m in messages], add_generation_prompt=True, tools=specs)
    except (LocalbatchError, ValueError):
        return None  # e.g. a template that refuses "tool" turns: the fallback rewrites them
    if tools and (CALL_OPEN not in text or any(t.function.name not in text for t in tools)):
        return None  # the template ignored the tools or asks for another call format
    if not tools and RESPONSE_OPEN not in text and any(m.role == "tool" for m in messages):
        return None
    return text


def _parameters(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()


def _native_message(message: ChatMessage) -> dict[str, Any]:
    """Hugging Face's conversation shape: tool-call arguments as objects, as templates index them."""
    out: dict[str, Any] = message.to_engine()
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": arguments_object(c)}}
                             for c in message.tool_calls]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def encode_rendered(engine: EngineClient, text: str) -> list[int]:
    """Token ids of rendered chat text with exactly one BOS, as the engine encodes conversations."""
    bos = engine.encode("", add_bos=True)
    ids = engine.encode(text, add_bos=False)
    return ids if not bos or ids[:len(bos)] == bos else [*bos, *ids]


def arguments_object(call: ToolCall) -> Any:
    """A past call's arguments as a JSON value (clients send a JSON string; a broken one stays text)."""
    args = call.function.arguments
    if not isinstance(args, str):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args


# --- the fallback ---------------------------------------------------------------------------------


def fallback_messages(messages: list[ChatMessage], tools: list[ToolDefinition],
                      choice: ToolChoice) -> list[dict[str, str]]:
    """The conversation in plain system/user/assistant turns, with the tools in the system prompt."""
    out: list[dict[str, str]] = []
    previous: ChatMessage | None = None
    for message in messages:
        if message.role == "tool":
            block = f"{RESPONSE_OPEN}\n{message.content or ''}\n{RESPONSE_CLOSE}"
            if previous is not None and previous.role == "tool":
                out[-1]["content"] += "\n" + block  # the results of one turn's calls share a user turn
            else:
                out.append({"role": "user", "content": block})
        elif message.tool_calls:
            calls = "\n".join(call_text(c.function.name, arguments_object(c)) for c in message.tool_calls)
            content = f"{message.content}\n{calls}" if message.content else calls
            out.append({"role": "assistant", "content": content})
        else:
            out.append(message.to_engine())
        previous = message
    if tools:
        _add_system_prompt(out, tools_system_prompt(tools, choice))
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def tools_system_prompt(tools: list[ToolDefinition], choice: ToolChoice) -> str:
    """The fallback's instructions: the signatures, the call format, and what `choice` demands."""
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    example = call_text("function_name", {"argument": "value"})
    if choice == "required":
        rule = "Answer with one or more function calls."
    elif not isinstance(choice, str):
        rule = f"Answer by calling the function {choice.function.name}."
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
