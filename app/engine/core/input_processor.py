"""Requests into sequences (vLLM's input processor): sampling params checked, the prompt tokenized,
its length checked against the context and the KV pool, its grammar compiled. Touches no engine
state, so it runs on any thread (the API's worker threads, off the step thread)."""

from __future__ import annotations

import itertools

from app.engine.core.sequence import Sequence
from app.engine.structured.compiler import ConstraintCompiler
from app.engine.text.tokenizer import Tokenizer
from app.engine.types.context_window import check_fits
from app.engine.types.errors import RequestError
from app.engine.types.prompt import Prompt
from app.engine.types.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, pool_tokens: int) -> None:
        """`pool_tokens`: the longest sequence the KV pool can hold on its own."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool_tokens = pool_tokens
        self.constraints = ConstraintCompiler(tokenizer, vocab_size)
        self._ids = itertools.count()

    def make_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request. Raises RequestError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling params must be a SamplingParams", param="params")
        params.validate()
        params.check_token_ids(self.vocab_size)
        ids = self.tokenize_prompt(prompt)
        max_tokens = check_fits(len(ids), params.max_tokens, self.max_model_len, self.pool_tokens)
        seq = Sequence(request_id or f"req-{next(self._ids)}", ids, params, max_tokens)
        seq.grammar = self.constraints.matcher_for(params)  # compiled here, off the step thread (cached)
        return seq

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", param="prompt")
            return self.require_tokenizer().encode(prompt, add_bos=True)
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("the prompt must be a non-empty string, token id list or message list", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of range [0, {vocab})", param="prompt")
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            return self.require_tokenizer().encode_chat(prompt, add_generation_prompt=True)
        raise RequestError("the prompt must be a string, a list of token ids or a list of messages", param="prompt")

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError("this engine has random weights and no tokenizer: send token ids", param="prompt")
        return self.tokenizer
