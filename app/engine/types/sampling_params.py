"""Per-request sampling settings (vLLM's names and meanings).

Structured output: at most one of `json_schema`, `json_object`, `regex`, `grammar` and
`structural_tag` constrains what a request may generate (xgrammar masks every token that would
leave the language). The constraint is compiled when the request is made, not on the step thread,
so a bad schema, regex or grammar is a `RequestError` naming its field.

- `json_schema`: a JSON Schema, as a dict or as JSON text. Properties come out in the schema's
  order; properties the schema does not list are not generated (xgrammar's strict mode); runs of
  whitespace between JSON tokens are capped (24 characters) so a small model cannot loop on
  newlines.
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
- `regex`: the whole output matches this regular expression.
- `grammar`: EBNF in xgrammar's dialect (GBNF-like: `root ::= "yes" | "no"`; the start rule is
  `root`).
- `structural_tag`: xgrammar's structural-tag format, as a dict or JSON text, e.g. tool calls:
  `{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
  "tags": [{"begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": {...}},
  "end": "</tool_call>"}], "at_least_one": false, "stop_after_first": false}}`. The text outside
  the tags is free; inside, the content's format applies ("type": "tag" on a tag is optional).
  Formats xgrammar 0.2.8 compiles for "format" and for a tag's "content": "const_string",
  "json_schema" (JSON whitespace capped as for json_schema unless it sets "max_whitespace_cnt"),
  "regex", "grammar", "any_text", "sequence", "or", "tag", "triggered_tags",
  "tags_with_separator", "optional", "plus", "star", "repeat". Token-level formats ("token",
  "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch") do not work here:
  control tokens are never generated inside a constraint, so write tags as text. vLLM's older form
  `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}` is
  accepted too.

`logit_bias` ({token id: bias}, each bias in [-100, 100], as OpenAI) is added to the logits before
penalties and temperature: +100 all but forces a token, -100 all but bans it. Token ids may come as
decimal strings (OpenAI's JSON keys) and are stored as ints.

Logprobs report the logits after the grammar mask (tokens the grammar forbids: -inf) but before
logit_bias, penalties and temperature, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.types.errors import RequestError


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
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    logit_bias: dict[int, float] | None = None

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
        self.logit_bias = _int_keys(self.logit_bias)
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
        self._validate_constraint()
        self._validate_logit_bias()

    # Each holds a language the output must belong to; two would have to be intersected.
    CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")

    @property
    def constraint_field(self) -> str | None:
        """The name of the structured-output field set, or None."""
        return next((f for f in self.CONSTRAINT_FIELDS if _is_set(getattr(self, f))), None)

    def _validate_constraint(self) -> None:
        kinds = {"json_schema": (dict, str), "json_object": (bool,), "regex": (str,), "grammar": (str,),
                 "structural_tag": (dict, str)}
        for name, types in kinds.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                allowed = " or ".join(t.__name__ for t in types)
                raise RequestError(f"invalid {name}: must be a {allowed}, not {type(value).__name__}", param=name)
            if isinstance(value, str) and not value.strip():
                raise RequestError(f"invalid {name}: it is empty", param=name)
        named = [f for f in self.CONSTRAINT_FIELDS if _is_set(getattr(self, f))]
        if len(named) > 1:
            raise RequestError(f"{named[0]} and {named[1]} are both set: a request takes at most one of "
                               f"{', '.join(self.CONSTRAINT_FIELDS)}", param=named[1])

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise RequestError(f"invalid logit_bias: must be a dict of token id -> bias, not {type(bias).__name__}",
                               param="logit_bias")
        for token, value in bias.items():
            if not (_int(token) and token >= 0):
                raise RequestError(f"invalid logit_bias key {token!r}: must be a token id (an integer >= 0)",
                                   param="logit_bias")
            if not (_num(value) and -100 <= value <= 100):
                raise RequestError(f"invalid logit_bias[{token}]={value!r}: must be a number in [-100, 100]",
                                   param="logit_bias")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise `RequestError` when a logit_bias token id is outside the model's vocabulary
        (only the engine knows its size)."""
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is out of range [0, {vocab_size})", param="logit_bias")

    @property
    def greedy(self) -> bool:
        # Temperatures this small cannot be divided by: they mean argmax (as in vLLM).
        return self.temperature < 1e-5


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_set(value: object) -> bool:
    # json_object=False means "not set"; every other constraint field is set when not None.
    return value is not None and value is not False


def _int_keys(bias: object) -> object:
    """OpenAI sends logit_bias keys as JSON strings ("50256"): decimal strings become ints. Anything
    else is left for `validate` to reject with a message."""
    if not isinstance(bias, dict):
        return bias
    return {int(k) if isinstance(k, str) and k.strip().isdecimal() else k: v for k, v in bias.items()}
