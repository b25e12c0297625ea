"""Per-request sampling settings (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.api.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: until the context (or the KV pool) is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt position
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(isinstance(s, str) for s in self.stop or []):
            raise RequestError(f"invalid stop={self.stop!r}: must be a string or a list of strings", param="stop")
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise RequestError(f"invalid stop_token_ids={self.stop_token_ids!r}: must be a list of token ids",
                               param="stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0  # -1 and 0 both disable top-k (vLLM accepts -1)
        self.validate()

    def validate(self) -> None:
        """Raise `RequestError` naming the first invalid field."""
        checks = [
            ("max_tokens", self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1), "must be an integer >= 1"),
            ("temperature", _num(self.temperature) and 0 <= self.temperature < float("inf"), "must be a finite number >= 0"),
            ("top_p", _num(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _int(self.top_k) and self.top_k >= 0, "must be an integer >= 1 (0 or -1 disables it)"),
            ("min_p", _num(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", _num(self.repetition_penalty) and self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", _num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", _num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("seed", self.seed is None or _int(self.seed), "must be an integer"),
            ("logprobs", self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= 20), "must be an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20), "must be an integer in [0, 20]"),
            ("n", _int(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("stop_token_ids", all(_int(t) and t >= 0 for t in self.stop_token_ids), "must be non-negative integers"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise RequestError(f"invalid {name}={getattr(self, name)!r}: {why}", param=name)

    @property
    def greedy(self) -> bool:
        # Temperatures this small cannot be divided by: they mean argmax (as in vLLM).
        return self.temperature < 1e-5


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
