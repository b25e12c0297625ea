"""Constraints compiled into xgrammar grammars, once per distinct constraint, and each sequence's
matcher made from them.

Runs where requests are made (`LLMEngine.make_sequence`: the caller's thread, or a worker thread
under AsyncEngine), never on the step thread: compiling a JSON schema against a large vocabulary
would stall every running sequence.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING

from app.engine.structured.cache import LRUCache
from app.engine.structured.constraint import Constraint, constraint_of
from app.engine.structured.json_schema import JSON_MAX_WHITESPACE
from app.engine.structured.matcher import SequenceGrammar
from app.engine.structured.tokenizer_info import build_tokenizer_info
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

    from app.engine.text.tokenizer import Tokenizer

# A compiled JSON grammar holds token masks for the whole vocabulary, so the cache counts bytes.
CACHE_BYTES = 256 * 2**20
_ANY_OBJECT = '{"type": "object"}'

# xgrammar's messages start with a timestamp and a C++ source location, and its internal checks
# add "Check failed: (...) is false:"; neither helps the user.
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"Check failed: \(.*?\) is false:\s*")


class ConstraintCompiler:
    """Owned by the engine. Builds xgrammar's tokenizer view and compiler on the first
    constrained request; safe to call from several threads at once."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, cache_bytes: int = CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache: LRUCache[Constraint, xgrammar.CompiledGrammar] = LRUCache(
            cache_bytes, weight=lambda g: g.memory_size_bytes)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        # Without a stop token a finished grammar has nothing left to allow: end on its last token.
        self._end_without_stop = tokenizer is None or not tokenizer.stop_token_ids

    def matcher_for(self, params: SamplingParams) -> SequenceGrammar | None:
        """A fresh matcher for the request's constraint, or None when it has none. Raises
        `RequestError` with `param` set to the constraint's field when it does not compile."""
        constraint = constraint_of(params)
        if constraint is None:
            return None
        compiled = self.compile(constraint)
        import xgrammar as xgr

        return SequenceGrammar(xgr.GrammarMatcher(compiled, terminate_without_stop_token=self._end_without_stop))

    def compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        compiled = self._cache.get(constraint)
        if compiled is None:
            # Two threads may compile the same new constraint at once; both results are equal.
            compiled = self._compile(constraint)
            self._cache.put(constraint, compiled)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, c: Constraint) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler(c.field)
        try:
            if c.field == "json_schema":
                return compiler.compile_json_schema(c.spec, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if c.field == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if c.field == "regex":
                return compiler.compile_regex(c.spec)
            if c.field == "grammar":
                return compiler.compile_grammar(c.spec)
            return compiler.compile_structural_tag(c.spec)
        except Exception as e:  # noqa: BLE001 - xgrammar reports every bad spec as RuntimeError/ValueError
            raise RequestError(f"invalid {c.field}: {_reason(e)}", param=c.field) from None

    def _xgrammar_compiler(self, field: str) -> xgrammar.GrammarCompiler:
        if self._tokenizer is None:
            raise RequestError(f"{field} needs the model's tokenizer, and this engine has random weights "
                               "and none", param=field)
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = build_tokenizer_info(self._tokenizer, self._vocab_size)
                # Half the cores: compiling must not starve the step thread of a running engine.
                threads = max(1, (os.cpu_count() or 2) // 2)
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler


def _reason(e: Exception) -> str:
    """xgrammar's message as one line a user can act on."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = _CHECK_PREFIX.sub("", _SOURCE_PREFIX.sub("", lines[0]))
    return text or type(e).__name__
