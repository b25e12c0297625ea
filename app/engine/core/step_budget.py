"""How many prompt tokens a step may carry beside running decodes (vLLM's "decodes first, then a
chunk budget"), sized for an inter-token latency target instead of a fixed count.

On a CPU a prompt token costs about as much compute as a whole decode step's weight reads are
worth at small batches: a 512-token chunk stalls every streaming reply for that step, and the
inter-token p99 is set by other requests' prefill. The budget keeps a step that carries decodes
under `target_s`, from a step-time model learned on the engine's own steps:

    step time = decode time at this many decode rows + prompt tokens x (cost of one + its deviation)

The decode time is measured per count of decode rows (decode-only steps); a count not measured
takes the next larger one's (an upper bound), or the largest one's plus a prompt token's cost per
extra row. A prompt token's cost is the part of a step's time beyond its decodes, per token; its
mean deviation is added (as TCP's retransmit timer adds the RTT's), so a noisy machine plans for a
slow step rather than an average one. Whatever the target, a step carries at least `min_chunk`
prompt tokens (a KV block): a prompt's first token comes after a bounded number of steps."""

from __future__ import annotations

# The default target: this, or ITL_FACTOR decode steps when those are longer. A longer target let
# prefill push the inter-token p99 at many streams above llama-server's, for no better TTFT
# (docs/tuning.md).
ITL_FLOOR_S = 0.06
ITL_FACTOR = 2.0
MIN_SAMPLE = 16  # prompt tokens a step needs before its time says what one costs
EMA = 0.3
TAIL_DEVS = 1.0  # a prompt token is planned at its mean cost plus this many mean deviations
# While prompts are read beside every step's decodes, no step is decode-only, so the decode time
# would never be measured (or go stale as contexts grow): one step in this many carries no prompt.
DECODE_SAMPLE_STEPS = 20
# A decode time measured this many steps ago no longer counts (contexts have grown since).
STALE_STEPS = 10 * DECODE_SAMPLE_STEPS


class PrefillBudget:
    """`observe()` every step; `cap(num_decode_tokens, num_seqs)` is the prompt-token budget of the
    next step. `target_s`: None, the default rule; 0, no limit beyond `max_tokens`."""

    def __init__(self, max_tokens: int, target_s: float | None = None, min_chunk: int = 16) -> None:
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.min_chunk = min(min_chunk, max_tokens)
        self.decode_s: dict[int, tuple[float, int]] = {}  # decode rows -> (recent time, step it was measured)
        self.token_s: float | None = None  # one prompt token, recent average
        self.token_dev = 0.0  # its recent mean deviation
        self.steps = 0
        self.mixed_steps = 0  # steps with decodes and prompt tokens since the last decode-only one

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        self.steps += 1
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                old = self.decode_s.get(num_decode_tokens)
                self.decode_s[num_decode_tokens] = (_ema(old[0] if old else None, seconds), self.steps)
                self.mixed_steps = 0
            return
        if num_decode_tokens:
            self.mixed_steps += 1
        base = self.decode_time(num_decode_tokens)
        # A step of the least chunk teaches the cost too: a cap stuck at it would never learn it fell.
        if num_prefill_tokens >= min(MIN_SAMPLE, self.min_chunk) and base is not None:
            sample = max(seconds - base, 0.0) / num_prefill_tokens
            if self.token_s is not None:
                self.token_dev = _ema(self.token_dev, abs(sample - self.token_s))
            self.token_s = _ema(self.token_s, sample)

    def decode_time(self, n: int) -> float | None:
        """A step of `n` decode rows and no prompt, predicted; None until one is measured."""
        if n == 0:
            return 0.0
        fresh = {m: t for m, (t, at) in self.decode_s.items() if self.steps - at < STALE_STEPS}
        above = [m for m in fresh if m >= n]
        if above:
            return fresh[min(above)]
        if not fresh or self.token_s is None:
            return None
        m = max(fresh)
        return fresh[m] + (n - m) * self.token_s  # each extra row costs at most what a prompt token does

    def cap(self, num_decode_tokens: int, num_seqs: int) -> int:
        """Prompt tokens the next step may carry, beside `num_decode_tokens` decode rows, while
        `num_seqs` sequences (those decodes and short prompts: replies soon) wait on it."""
        if not num_seqs or self.target_s == 0:
            return self.max_tokens
        base = self.decode_time(num_decode_tokens)
        if base is None or (num_decode_tokens and self.mixed_steps >= DECODE_SAMPLE_STEPS):
            return 0  # a decode-only step, to measure one: replies must not wait on a guess
        if self.token_s is None:
            return self.min_chunk  # a small chunk, to measure a prompt token
        per_token = max(self.token_s + TAIL_DEVS * self.token_dev, 1e-9)
        tokens = int((self.target(num_seqs) - base) / per_token)
        return max(self.min_chunk, min(tokens, self.max_tokens))

    def target(self, num_seqs: int) -> float:
        """The step time to stay under, with `num_seqs` sequences waiting on the step."""
        if self.target_s is not None:
            return self.target_s
        ref = self.decode_time(max(num_seqs, 1))
        return max(ITL_FLOOR_S, ITL_FACTOR * ref) if ref is not None else ITL_FLOOR_S


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
