"""Streaming decode of generated token ids into text."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: the detokenizer works on any built Tokenizer
    from app.engine.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Streaming decode of generated ids: `add()` returns only the text completed by the new ids.

    Pieces are bytes, so the state is just an incremental UTF-8 decoder holding at most the
    first 3 bytes of a character whose byte-fallback tokens have not all arrived: O(1) per token,
    without a re-decoding window.
    The concatenation of every `add()` result and a final `flush()` equals `decode(output_ids)`
    (without `prompt_ids`), or the text that `output_ids` add to `decode(prompt_ids)` (with them:
    the first output token is not at the start of the text, so its leading space is kept).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._num_tokens = 0
        # llama.cpp strips one leading space off the first token of a text (SPM space prefix).
        self._strip_space = tokenizer.add_space_prefix and not prompt_ids

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, token_ids: Iterable[int]) -> str:
        """Text completed by `token_ids`; a partial UTF-8 character waits for its next bytes."""
        tok = self.tokenizer
        parts = []
        for token_id in token_ids:
            piece = tok.token_to_bytes(token_id, self.skip_special_tokens)
            if self._strip_space:
                piece = self._strip_first(token_id, piece)
            self._num_tokens += 1
            if piece:
                parts.append(piece)
        return self._utf8.decode(b"".join(parts)) if parts else ""

    def _strip_first(self, token_id: int, piece: bytes) -> bytes:
        tok = self.tokenizer
        skipped_bos = (self._num_tokens == 0 and self.skip_special_tokens and tok.add_bos
                       and token_id == tok.bos_token_id)
        if skipped_bos:
            return piece
        self._strip_space = False
        return piece[1:] if piece.startswith(b" ") else piece

    def flush(self) -> str:
        """At the end of the stream: U+FFFD for a UTF-8 character that never completed."""
        return self._utf8.decode(b"", final=True)
