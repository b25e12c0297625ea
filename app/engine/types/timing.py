"""One definition of a reply's latency figures, used wherever a reply is timed: the engine (per
sequence), the TUI (per tab, also against remote backends) and the HTTP engine client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplyTiming:
    ttft_s: float | None  # time to first token
    itl_s: float | None  # mean inter-token latency after the first token
    tokens_per_s: float | None  # decode rate: 1 / itl


def reply_timing(
    started: float, first_token_at: float | None, last_token_at: float | None, num_tokens: int
) -> ReplyTiming:
    """Figures from the clock readings of one reply. The first token is the prefill's: it has no
    gap before it that belongs to decoding, so rates use the `num_tokens - 1` gaps after it."""
    if first_token_at is None:
        return ReplyTiming(None, None, None)
    ttft = first_token_at - started
    if last_token_at is None or num_tokens < 2 or last_token_at <= first_token_at:
        return ReplyTiming(ttft, None, None)
    itl = (last_token_at - first_token_at) / (num_tokens - 1)
    return ReplyTiming(ttft, itl, 1.0 / itl)


@dataclass
class ReplyClock:
    """The clock readings of one reply, taken by a client as its deltas arrive (the TUI per tab,
    the HTTP engine client per request)."""

    started: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0

    def tick(self, now: float) -> None:
        """Output arrived at `now`; the caller counts the tokens."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    def timing(self) -> ReplyTiming:
        return reply_timing(self.started, self.first_token_at, self.last_token_at, self.num_tokens)
