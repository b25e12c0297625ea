"""The context's arithmetic, in one place: whether a prompt and the tokens asked for fit
(`check_fits`, the engine's check), what the context leaves a prompt beside a reply
(`prompt_budget`) and a reply after a prompt (`reply_room`); and what to do when a chat no longer
fits: the overflow policies the app and the HTTP endpoint share. `drop_oldest_turns` keeps the
system messages and the newest turn and drops whole turns (a user message and the replies after
it) from the oldest on, so what the model reads is still a well-formed conversation.

A context of 0 is unknown (a remote server that does not say): nothing is cut or refused for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from app.engine.types.errors import RequestError

OVERFLOW_STOP = "stop"  # refuse with a message that says how far over it is
OVERFLOW_DROP_OLDEST = "drop_oldest"  # drop the oldest turns, keep the system prompt
OVERFLOW_POLICIES = (OVERFLOW_STOP, OVERFLOW_DROP_OLDEST)

Message = dict[str, Any]


class ContextOverflowError(RequestError):
    """The prompt does not fit the context (and the policy could not make it fit)."""

    def __init__(self, message: str, num_tokens: int, budget: int) -> None:
        super().__init__(message, param="messages")
        self.num_tokens = num_tokens
        self.budget = budget


def prompt_budget(context: int, max_tokens: int | None) -> int:
    """Tokens a prompt may take so that `max_tokens` more fit the context; without `max_tokens`
    (generate until the context is full) at least one token is generated."""
    return context - (max_tokens or 1)


def reply_room(context: int, num_prompt_tokens: int, max_tokens: int | None) -> int | None:
    """`max_tokens` cut to what the context leaves after the prompt; unchanged (None included)
    when the context is unknown or the prompt alone fills it (the engine's check then says so)."""
    if max_tokens is None or context <= num_prompt_tokens:
        return max_tokens
    return min(max_tokens, context - num_prompt_tokens)


def check_fits(num_prompt_tokens: int, max_tokens: int | None, context: int, pool_tokens: int) -> int:
    """The request's max_tokens: as asked, or (None) all that the context and the KV pool leave.
    `pool_tokens`: the longest sequence the KV pool can hold. Raises `RequestError` naming the
    field that does not fit."""
    if num_prompt_tokens >= context:
        raise RequestError(f"the prompt has {num_prompt_tokens} tokens but the context holds {context} "
                           "(and at least one must be generated)", param="prompt")
    if max_tokens is None:
        left = min(context, pool_tokens) - num_prompt_tokens
        if left < 1:
            raise RequestError(f"the prompt has {num_prompt_tokens} tokens but the KV pool holds {pool_tokens}; "
                               "raise --kv-cache-bytes / --kv-cache-blocks", param="prompt")
        return left
    total = num_prompt_tokens + max_tokens
    if total > context:
        raise RequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                           f"exceeds the context length {context}", param="max_tokens")
    if total > pool_tokens:
        raise RequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) can never fit the KV "
                           f"pool of {pool_tokens} tokens; raise --kv-cache-bytes / --kv-cache-blocks or lower "
                           "max_tokens", param="max_tokens")
    return max_tokens


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Indices of the user messages that open a turn (system messages belong to no turn)."""
    return [i for i, m in enumerate(messages) if m.get("role") == "user"]


def without_turns(messages: Sequence[Message], dropped: int) -> list[Message]:
    """`messages` less their first `dropped` turns; system messages always stay."""
    starts = turn_starts(messages)
    if dropped <= 0 or not starts:
        return list(messages)
    cut_from, cut_to = starts[0], starts[dropped] if dropped < len(starts) else len(messages)
    return [m for i, m in enumerate(messages) if not (cut_from <= i < cut_to) or m.get("role") == "system"]


def drop_oldest_turns(messages: Sequence[Message], count_tokens: Callable[[list[Message]], int],
                      budget: int) -> tuple[list[Message], int]:
    """The fewest oldest turns dropped so that `count_tokens(kept) <= budget`; returns (kept, its
    token count, as already counted here). The newest turn is never dropped: raises `ContextOverflowError`
    when it and the system messages alone are over `budget`. Token counts fall as turns go, so a
    binary search needs O(log turns) counts, not one per turn."""
    total = count_tokens(list(messages))
    if total <= budget:
        return list(messages), total
    most = max(len(turn_starts(messages)) - 1, 0)
    least_left = count_tokens(without_turns(messages, most))
    if least_left > budget:
        raise ContextOverflowError(
            f"even the last message alone takes {least_left:,} tokens, over the {budget:,} the context leaves "
            "for the prompt: shorten it, or lower max tokens", least_left, budget)
    lo, hi, fitting = 1, most, least_left  # hi always fits, in `fitting` tokens
    while lo < hi:
        mid = (lo + hi) // 2
        tokens = count_tokens(without_turns(messages, mid))
        if tokens <= budget:
            hi, fitting = mid, tokens
        else:
            lo = mid + 1
    return without_turns(messages, hi), fitting


def overflow_message(num_tokens: int, budget: int, context: int) -> str:
    """The one line a `stop` policy says."""
    return (f"this chat no longer fits the context: the prompt takes {num_tokens:,} tokens, {budget:,} are left for "
            f"it of {context:,} (after max tokens); fork at a later message, lower max tokens, or set the "
            "overflow policy to drop the oldest turns")
