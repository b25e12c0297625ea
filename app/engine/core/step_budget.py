"""How many prompt tokens a step may carry beside running decodes (vLLM's "decodes first, then a
chunk budget"), sized for a latency target instead of a fixed count.

On a CPU a prompt token costs about as much compute as a whole decode step's weight reads are
worth at small batches: a 512-token chunk stalls every streaming reply for that step, and at 16
clients the inter-token p99 was set by other requests' prefill. The budget here keeps a step that
carries decodes near `target_s`: it learns the decode-only step time and the cost of a prompt token
from the steps the engine runs, and gives prefill what is left of the target."""

from __future__ import annotations

# The default target: this, or ITL_FACTOR decode steps when those are longer. A longer target let
# prefill push the inter-token p99 at many streams above llama-server's, for no better TTFT
# (docs/tuning.md).
ITL_FLOOR_S = 0.06
ITL_FACTOR = 2.0
MIN_CHUNK = 32  # below this a prompt's matrix products lose their row-blocking and TTFT suffers
MIN_SAMPLE = 16  # prompt tokens a step needs before its time says what one costs
EMA = 0.3
# While prompts are read beside every step's decodes, no step is decode-only, so the decode time
# would never be measured (or go stale as contexts grow): one step in this many carries no prompt.
DECODE_SAMPLE_STEPS = 20


class PrefillBudget:
    """`observe()` every step; `cap(num_decodes)` is the prompt-token budget of the next step."""

    def __init__(self, max_tokens: int, target_s: float | None = None) -> None:
        self.max_tokens = max_tokens
        self.target_s = target_s  # None: the default rule; 0: no limit beyond max_tokens
        self.decode_s: float | None = None  # a decode-only step, recent average
        self.token_s: float | None = None  # one prompt token, recent average
        self.mixed_steps = 0  # steps with decodes and prompt tokens since the last decode-only one

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                self.decode_s = _ema(self.decode_s, seconds)
                self.mixed_steps = 0
            return
        if num_decode_tokens:
            self.mixed_steps += 1
        if num_prefill_tokens >= MIN_SAMPLE:
            base = (self.decode_s or 0.0) if num_decode_tokens else 0.0
            self.token_s = _ema(self.token_s, max(seconds - base, 0.0) / num_prefill_tokens)

    def cap(self, num_decodes: int) -> int:
        if not num_decodes or self.target_s == 0:
            return self.max_tokens
        if self.decode_s is None or self.mixed_steps >= DECODE_SAMPLE_STEPS:
            return 0  # a decode-only step, to measure one: replies must not wait on a guess
        if self.token_s is None:
            return MIN_CHUNK  # a small chunk, to measure a prompt token
        target = self.target_s or max(ITL_FLOOR_S, ITL_FACTOR * self.decode_s)
        tokens = int((target - self.decode_s) / self.token_s) if self.token_s > 0 else self.max_tokens
        return max(MIN_CHUNK, min(tokens, self.max_tokens))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
