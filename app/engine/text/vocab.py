"""Vocabulary entries: the kind of each token and the bytes each token decodes to.

Decoding bypasses Hugging Face `tokenizers`: it joins these per-token byte pieces exactly as
llama.cpp's `token_to_piece` writes them, which is what makes incremental detokenization exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def utf8(text: str) -> bytes:
    """`text` as UTF-8 bytes, tolerating token texts that were not valid UTF-8 in the file."""
    # Such texts come back from the GGUF reader as surrogate escapes.
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def build_pieces(tokens: Sequence[str], types: np.ndarray, byte_level: bool) -> list[bytes]:
    """What each token decodes to (llama.cpp token_to_piece with special=True)."""
    pieces = _bpe_normal_pieces(tokens) if byte_level else _spm_normal_pieces(tokens)
    others = np.nonzero((types != TokenType.NORMAL) & (types != TokenType.UNDEFINED))[0]
    for i, kind in zip(others.tolist(), types[others].tolist()):
        if kind == TokenType.BYTE:
            pieces[i] = _byte_piece(tokens[i])
        elif kind == TokenType.UNUSED:
            pieces[i] = b""
        else:  # control, unknown and user-defined tokens are written as their text
            pieces[i] = utf8(tokens[i])
    return pieces


def _gpt2_byte_chars() -> list[str]:
    """Byte -> character table of byte-level BPE: printable Latin-1 bytes stand for themselves,
    the rest are moved to U+0100.. so that every token text is printable."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, moved = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + moved))
            moved += 1
    return chars


def _byte_piece(text: str) -> bytes:
    # `<0xXX>`; anything else marked BYTE is rendered as its text.
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return utf8(text)


def _spm_normal_pieces(tokens: Sequence[str]) -> list[bytes]:
    """Every token read as an SPM piece (`▁` is a space); one join/split instead of 262k calls."""
    joined = "\x00".join(tokens).replace("\u2581", " ")
    try:
        pieces = joined.encode("utf-8", "surrogateescape").split(b"\x00")
    except UnicodeEncodeError:
        pieces = []
    if len(pieces) != len(tokens):  # a token holds NUL or an unencodable character
        pieces = [utf8(t.replace("\u2581", " ")) for t in tokens]
    return pieces


def _bpe_normal_pieces(tokens: Sequence[str]) -> list[bytes]:
    """Every token read as byte-level BPE text: each character stands for one byte."""
    chars = _gpt2_byte_chars()
    byte_of = {c: b for b, c in enumerate(chars)}
    if set("".join(tokens)) <= byte_of.keys():
        table = str.maketrans({c: chr(b) for b, c in enumerate(chars)})
        return [t.translate(table).encode("latin-1") for t in tokens]
    # Some text is not byte-level (added tokens): keep such characters as UTF-8.
    return [b"".join(bytes([byte_of[c]]) if c in byte_of else utf8(c) for c in t) for t in tokens]
