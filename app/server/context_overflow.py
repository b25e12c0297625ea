"""What a request may ask for when its prompt does not fit the context. By default nothing: the
engine's 400 (`context_length_exceeded`) stands, as OpenAI answers. Opt-ins: vLLM's
`truncate_prompt_tokens` (keep the prompt's last k tokens; both generation routes) and localbatch's
`context_overflow: "drop_oldest"` (chat: drop the oldest whole turns, keep the system messages and
the newest turn; the terminal app's policy, `app.engine.types.context_window`).

A prompt is tokenized once: where the server counted or cut it, its token ids go to the engine,
which reads them as they are; otherwise the engine tokenizes it."""

from __future__ import annotations

from typing import Any

from app.engine.api.engine_client import Prompt
from app.engine.types.context_window import ContextOverflowError, drop_oldest_turns, prompt_budget
from app.engine.types.errors import RequestError
from app.server.http_errors import CONTEXT_LENGTH_EXCEEDED, ApiError
from app.server.openai_schema import ChatMessage
from app.server.output_schema import ToolChoice, ToolDefinition
from app.server.serving import ServerState
from app.server.tool_prompt import chat_prompt, encode_rendered

# Set on a chat response (streamed or not) whose oldest messages were dropped to fit the context.
DROPPED_HEADER = "x-localbatch-dropped-messages"
TRUNCATE_PARAM = "truncate_prompt_tokens"


def prompt_ids(state: ServerState, prompt: Prompt) -> list[int]:
    """The token ids the engine makes of `prompt`, so that what is counted or cut is what it reads:
    text gets a BOS, a conversation is templated with exactly one BOS, token ids stay."""
    if isinstance(prompt, str):
        return state.engine.encode(prompt, add_bos=True)
    if prompt and all(isinstance(m, dict) for m in prompt):
        return encode_rendered(state.engine, state.render_chat(prompt))  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def truncation_length(requested: int | None, context: int, max_tokens: int | None) -> int | None:
    """How many of the prompt's last tokens `truncate_prompt_tokens` keeps; None: all of them.
    -1 keeps as many as fit beside `max_tokens` (at least one token is generated)."""
    if requested is None:
        return None
    if context and requested > context:
        raise RequestError(f"{TRUNCATE_PARAM} is {requested}, more than the model's context of {context} "
                           "tokens: ask for fewer, or -1 for as many as fit", param=TRUNCATE_PARAM)
    if requested == -1:
        return max(prompt_budget(context, max_tokens), 1) if context else None  # a context of 0: unknown, cut nothing
    return requested


def truncated(state: ServerState, prompt: Prompt, keep: int | None) -> tuple[Prompt, bool]:
    """`prompt` as token ids cut from the left to its last `keep` tokens, and whether it was cut;
    unchanged when `keep` is None. Token ids are not tokenized again."""
    if keep is None:
        return prompt, False
    ids = prompt if is_token_ids(prompt) else prompt_ids(state, prompt)
    return (ids[-keep:], True) if len(ids) > keep else (ids, False)


def is_token_ids(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def fit_conversation(state: ServerState, messages: list[ChatMessage], policy: str, max_tokens: int | None,
                     tools: list[ToolDefinition], choice: ToolChoice) -> tuple[Prompt, int]:
    """The prompt to send under `policy` (as `chat_prompt` makes it, tools included), and how many
    messages were dropped. With "drop_oldest", the oldest turns go until the prompt leaves room for
    `max_tokens`, or one token, and the prompt is the token ids counted for the kept messages;
    raises a 400 naming `messages` when the newest turn alone is too long."""
    context = state.engine.max_model_len
    budget = prompt_budget(context, max_tokens)
    if policy != "drop_oldest" or not context or budget < 1:
        # No context known, or max_tokens alone fills it: the engine's 400 says so.
        return chat_prompt(state.engine, messages, tools, choice), 0
    # Stand-ins in `drop_oldest_turns`' shape; OpenAI's "developer" messages are system prompts.
    stand_ins: list[dict[str, Any]] = [{"role": "system" if m.role == "developer" else m.role, "index": i}
                                       for i, m in enumerate(messages)]

    def picked(kept: list[dict[str, Any]]) -> list[ChatMessage]:
        return [messages[m["index"]] for m in kept]

    counted: dict[int, list[int]] = {}  # each candidate's ids by its message count (fewer as turns go)

    def count_tokens(kept: list[dict[str, Any]]) -> int:
        ids = counted[len(kept)] = prompt_ids(state, chat_prompt(state.engine, picked(kept), tools, choice))
        return len(ids)

    try:
        kept, _ = drop_oldest_turns(stand_ins, count_tokens, budget)
    except ContextOverflowError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages", code=CONTEXT_LENGTH_EXCEEDED) from exc
    return counted[len(kept)], len(messages) - len(kept)
