"""How much of a chat the next request can carry: its prompt tokens, and the plan that makes it
fit the context with room for a reply (the chat's overflow policy: leave the oldest turns out, or
stop and say so)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.engine.api.engine_client import EngineClient
from app.engine.api.tool_use import FunctionSpec, chat_prompt
from app.engine.types.context_window import (
    OVERFLOW_STOP,
    ContextOverflowError,
    drop_oldest_turns,
    overflow_message,
    turn_starts,
    without_turns,
)
from app.tools.guidance import with_guidance
from app.ui.session.history import completion_prompt
from app.ui.user_config import ChatSettings

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ContextPlan:
    """One request's fit: its prompt tokens (None: not counted, a remote server answers for
    itself), the oldest turns it leaves out, and its max tokens when cut to what is left."""

    used: int | None = None
    left_out: int = 0
    max_tokens: int | None = None

    def left_out_messages(self, history: Messages) -> int:
        """How many of `history`'s oldest messages this plan goes without (0: none)."""
        if not self.left_out:
            return 0
        return len(history) - len(without_turns(history, self.left_out))


def count_tokens(engine: EngineClient, messages: Messages) -> int:
    """The prompt tokens `messages` make, from the engine's own chat template and tokenizer; a
    remote server's are not known here (an HTTP call per keystroke): about 4 characters a token."""
    if engine.is_remote:
        return sum(len(str(m["content"])) + len(str(m.get("tool_calls") or "")) for m in messages) // 4 + 4 * len(messages)
    text = engine.apply_chat_template(messages) if engine.chat_template else completion_prompt(messages)
    return len(engine.encode(text))


def tools_tokens(engine: EngineClient, tools: Messages) -> int:
    """The tokens that offering `tools` (OpenAI entries) adds to every prompt: their definitions,
    as the template (or the fallback's system prompt) writes them, and the guidance on using them."""
    if not tools:
        return 0
    probe = [{"role": "user", "content": "x"}]
    prompt = chat_prompt(engine, with_guidance(probe, tools), [FunctionSpec.from_openai(t) for t in tools], "auto")
    with_tools = len(prompt) if prompt and isinstance(prompt[0], int) else count_tokens(engine, prompt)
    return max(with_tools - count_tokens(engine, probe), 0)


def context_limit(engine: EngineClient, kv_pool_tokens: int) -> int:
    """What a request can really get: the context, or the KV pool when that is smaller (0: not known)."""
    return min((n for n in (engine.max_model_len, kv_pool_tokens) if n), default=0)


def plan_fit(engine: EngineClient, messages: Messages, settings: ChatSettings, kv_pool_tokens: int,
             extra_tokens: int = 0) -> ContextPlan:
    """Plan a request of `messages` so that its prompt fits the context with room for a reply: max
    tokens, or a quarter of the context when max tokens is more (the reply is then cut to what is
    left). Raises `ContextOverflowError` under the `stop` policy, or when even the last message
    alone is too long."""
    context = context_limit(engine, kv_pool_tokens)
    if not context:
        return ContextPlan()
    budget = context - min(settings.max_tokens, context // 4)
    left_out = 0
    if settings.context_overflow == OVERFLOW_STOP:
        used = count_tokens(engine, messages) + extra_tokens
        if used > budget:
            raise ContextOverflowError(overflow_message(used, budget, context), used, budget)
    else:
        kept, used = drop_oldest_turns(messages, lambda m: count_tokens(engine, m) + extra_tokens, budget)
        left_out = len(turn_starts(messages)) - len(turn_starts(kept))
    max_tokens = context - used if used + settings.max_tokens > context else None
    return ContextPlan(used, left_out, max_tokens)


class ContextBudget:
    """A chat's use of the context: the plan of its last request, its prompt tokens so far (counted
    once per change, not per keystroke), and the engine figures the stats poll sets (the KV pool's
    size, the recent prefill rate)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self.plan = ContextPlan()  # the current (or last) request's
        self.kv_pool_tokens = 0
        self.prefill_rate = 0.0  # tokens/s
        self._chat_tokens: int | None = None  # the chat's prompt so far; None: not counted yet
        self._warned_full = False
        self._tools: tuple[str, ...] = ()  # the tools offered, by name, when `tools_tokens` was counted
        self.tools_tokens = 0  # what their definitions add to every prompt

    @property
    def approximate(self) -> bool:
        """Counts are estimates (a remote server's tokenizer is not here)."""
        return self._engine.is_remote

    @property
    def context(self) -> int:
        return self._engine.max_model_len

    @property
    def counted_yet(self) -> bool:
        return self._chat_tokens is not None

    def count(self, messages: Messages) -> int:
        return count_tokens(self._engine, messages)

    def offer(self, tools: Messages) -> None:
        """The tools the next request offers: their definitions count from here on (counted again
        only when the set changes)."""
        names = tuple(t["function"]["name"] for t in tools)
        if names != self._tools:
            self._tools, self.tools_tokens = names, tools_tokens(self._engine, tools)
            self._chat_tokens = None

    def fit(self, messages: Messages, settings: ChatSettings) -> ContextPlan:
        """Plan the next request of `messages` (see `plan_fit`); it is `plan` from here on."""
        self.plan = ContextPlan()
        self.plan = plan_fit(self._engine, messages, settings, self.kv_pool_tokens, self.tools_tokens)
        return self.plan

    def chat_tokens(self, history: Messages, recount: bool = False) -> int:
        """The prompt tokens of the chat as it stands (`history`), counted when it changed."""
        if recount or self._chat_tokens is None:
            self._chat_tokens = self.count(history) + self.tools_tokens if history else 0
        return self._chat_tokens

    def counted(self, tokens: int | None) -> None:
        """The chat's tokens are known (a request just counted them), or not (None: count again)."""
        self._chat_tokens = tokens

    def full_warning(self, title: str, settings: ChatSettings, settings_key: str) -> str | None:
        """Once per chat, past 80% of the context: what happens at 100% (the chosen overflow policy)."""
        used, context = self._chat_tokens or 0, self.context
        if not context or used < 0.8 * context or self._warned_full:
            return None
        self._warned_full = True
        then = ("new messages are refused (stop policy)" if settings.context_overflow == OVERFLOW_STOP
                else "the oldest turns are left out of what the model reads")
        return (f"“{title}” uses {used / context:.0%} of its {context:,}-token context; when it is full, {then}. "
                f"Settings ({settings_key}) choose.")
