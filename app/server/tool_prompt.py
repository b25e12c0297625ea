"""The endpoint's request types in the shared tool vocabulary (`app.engine.api.tool_use`): its
`ChatMessage`s as OpenAI-style dicts, its `ToolDefinition`s as `FunctionSpec`s and its
tool_choice as a `ToolChoiceSpec`; and the prompt of a chat request with tools or tool history."""

from __future__ import annotations

from typing import Any

from app.engine.api import tool_use
from app.engine.api.engine_client import EngineClient, Prompt
from app.engine.api.tool_use import FunctionSpec, NamedChoice, ToolChoiceSpec, encode_rendered
from app.server.openai_schema import ChatMessage
from app.server.output_schema import ToolChoice, ToolDefinition

__all__ = ["chat_prompt", "choice_spec", "encode_rendered", "fallback_messages", "function_specs",
           "tools_system_prompt"]


def function_specs(tools: list[ToolDefinition]) -> list[FunctionSpec]:
    return [FunctionSpec(t.function.name, t.function.description, t.function.parameters, t.function.strict)
            for t in tools]


def choice_spec(choice: ToolChoice) -> ToolChoiceSpec:
    return choice if isinstance(choice, str) else NamedChoice(choice.function.name)


def _dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], tools: list[ToolDefinition],
                choice: ToolChoice) -> Prompt:
    return tool_use.chat_prompt(engine, _dicts(messages), function_specs(tools), choice_spec(choice))


def fallback_messages(messages: list[ChatMessage], tools: list[ToolDefinition],
                      choice: ToolChoice) -> list[dict[str, str]]:
    return tool_use.fallback_messages(_dicts(messages), function_specs(tools), choice_spec(choice))


def tools_system_prompt(tools: list[ToolDefinition], choice: ToolChoice) -> str:
    return tool_use.tools_system_prompt(function_specs(tools), choice_spec(choice))
