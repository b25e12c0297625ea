"""What the model reads of a chat: its stored messages as OpenAI-style chat messages (tool calls
and tool results included) for a model with a chat template, or as a plain-text transcript for a
base model, and the request (prompt + sampling parameters) built from them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from app.engine.types.context_window import without_turns
from app.engine.types.prompt import Prompt
from app.engine.types.sampling_params import SamplingParams
from app.ui.store import MessageRecord
from app.ui.user_config import ChatSettings

# Completion mode (a base model: no chat template). The transcript is plain text the model
# continues: the system prompt (if any) as a first paragraph, then one "User: ..." / "Assistant:
# ..." block per message, ending with "Assistant:". The reply ends at EOS, at max tokens, or when
# the model starts the next user turn (BASE_MODEL_STOP, which is cut from the reply).
_SPEAKERS = {"user": "User", "assistant": "Assistant", "system": "System", "tool": "Tool"}
BASE_MODEL_STOP = "\nUser:"


def chat_message(message: MessageRecord) -> dict[str, Any]:
    """One stored message as a chat template takes it: an assistant's `tool_calls`, a tool
    result's `tool_call_id` and `name`, only where the message has them."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id or ""
        if message.name:
            out["name"] = message.name
    return out


def chat_history(system_prompt: str, messages: list[MessageRecord]) -> list[dict[str, Any]]:
    """The chat as the model reads it: the system prompt (when there is one), then every message."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    return system + [chat_message(m) for m in messages]


def completion_prompt(history: list[dict[str, Any]]) -> str:
    """`history` (chat messages) as a plain-text transcript for a base model to continue."""
    parts = []
    for m in history:
        content = str(m["content"]).strip()
        parts.append(content + "\n" if m["role"] == "system" else f"{_SPEAKERS.get(m['role'], m['role'])}: {content}")
    return "\n".join(parts + ["Assistant:"])


def build_request(history: list[dict[str, Any]], settings: ChatSettings, chat_template: bool, *, left_out: int = 0,
                  max_tokens: int | None = None) -> tuple[Prompt, SamplingParams]:
    """What the next reply is generated from: `history` less its `left_out` oldest turns, as chat
    messages for a model with a chat template; for a base model the plain-text transcript
    (`completion_prompt`) with BASE_MODEL_STOP added to the stop strings. `max_tokens` replaces the
    settings' (a reply cut to the context left). Raises `RequestError` naming a bad setting."""
    params = settings.to_params()
    if max_tokens is not None:
        params = replace(params, max_tokens=max_tokens)
    history = without_turns(history, left_out)
    if chat_template:
        return history, params
    return completion_prompt(history), replace(params, stop=[*(params.stop or []), BASE_MODEL_STOP])
