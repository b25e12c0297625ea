"""`speculative_config`, spelled as vLLM spells it: prompt lookup (`{"method": "ngram", ...}`) or a
draft model (`{"model": NAME_OR_PATH, ...}`), as a dict or its JSON text."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from app.engine.types.errors import LocalbatchError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 8  # ngram: the longest suffix looked up in the context
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: a catalog name or a GGUF path
    # draft_model: try prompt lookup first, and run the draft model only for the sequences it finds
    # nothing for (a reply that repeats its prompt drafts for free); prompt_lookup_min 4 or more keeps
    # short chance matches from displacing the draft model's better guesses.
    prompt_lookup: bool = False
    # Off for a step with more running decodes than this (vLLM's disable_by_batch_size). Below it,
    # each sequence drafts only as far as its acceptance rate pays for the measured verify cost.
    disable_by_batch_size: int = 4

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a dict or JSON text; None stays None. Raises LocalbatchError naming the problem."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise LocalbatchError(f"speculative config is not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(value, dict):
            raise LocalbatchError("speculative config must be a JSON object, e.g. {\"method\": \"ngram\"}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise LocalbatchError(f"unknown speculative config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft_model"}
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise LocalbatchError(f"unknown speculative method {self.method!r}: choose {' or '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LocalbatchError(f"invalid speculative {name}={value!r}: must be a positive integer")
        if self.num_speculative_tokens > 16:
            raise LocalbatchError(f"num_speculative_tokens={self.num_speculative_tokens} is too many: at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise LocalbatchError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise LocalbatchError("a draft_model speculative config needs \"model\": a catalog name or a GGUF path")
        if not isinstance(self.prompt_lookup, bool):
            raise LocalbatchError(f"invalid speculative prompt_lookup={self.prompt_lookup!r}: must be true or false")
        if self.method == "ngram" and self.model:
            raise LocalbatchError("the ngram method takes no \"model\"; drop it or drop \"method\"")
