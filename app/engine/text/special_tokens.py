"""Special tokens written in the text (`<start_of_turn>`, `<|im_start|>`...), cut out before BPE.

They are cut out in Python, in llama.cpp's order (longest first), because HF's added-token
matcher is leftmost-longest and can disagree with llama.cpp.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any


class SpecialSplitter:
    """Cuts special tokens out of text exactly as llama.cpp's `tokenizer_st_partition`: each
    token in turn, longest (in UTF-8 bytes) first, is split out of the text that is still raw,
    leftmost occurrences first. That order can differ from a leftmost-longest scan (with tokens
    "ab" and "bcd", "abcd" splits as "a" + "bcd").

    Searching for thousands of tokens (Gemma has 6,414) in long text would be slow, so a trie
    regex over the tokens' first `_PREFIX` characters first finds, at every position, the longest
    such prefix starting there; only tokens whose prefix is a prefix of one of those can occur.
    """

    _PREFIX = 32  # bounds the trie's depth (and the regex's nesting) for very long tokens

    def __init__(self, specials: Sequence[tuple[int, str]]) -> None:
        """`specials`: (id, text) in the order llama.cpp tries them."""
        self._rank: dict[str, tuple[int, int]] = {}  # text -> (order, id); the first id wins
        for order, (token_id, text) in enumerate(specials):
            self._rank.setdefault(text, (order, token_id))
        self._by_prefix: dict[str, list[str]] = {}
        for text in self._rank:
            self._by_prefix.setdefault(text[:self._PREFIX], []).append(text)
        # Compiled on first use: a tokenizer that never parses special tokens pays nothing.
        self._regex: re.Pattern[str] | None = None
        self._candidates: dict[str, tuple[str, ...]] = {}

    def split(self, text: str) -> list[str | int]:
        """`text` as raw fragments (str) and special-token ids (int), in order."""
        tokens = self._tokens_in(text)
        if not tokens:
            return [text] if text else []
        claimed = bytearray(len(text))
        spans: list[tuple[int, int, int]] = []
        for token in sorted(tokens, key=self._rank.__getitem__):
            self._claim(text, token, claimed, spans)
        spans.sort()
        parts: list[str | int] = []
        pos = 0
        for start, end, token_id in spans:
            if start > pos:
                parts.append(text[pos:start])
            parts.append(token_id)
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _claim(self, text: str, token: str, claimed: bytearray, spans: list[tuple[int, int, int]]) -> None:
        token_id, n = self._rank[token][1], len(token)
        pos = text.find(token)
        while pos != -1:
            hit = claimed.find(1, pos, pos + n)
            if hit == -1:
                spans.append((pos, pos + n, token_id))
                claimed[pos:pos + n] = b"\x01" * n
                pos = text.find(token, pos + n)
                continue
            # Overlaps text already split out: the next chance starts past that stretch.
            free = claimed.find(0, hit)
            pos = -1 if free == -1 else text.find(token, free)

    def _tokens_in(self, text: str) -> set[str]:
        """The special tokens that may occur in `text` (a small superset of those that do)."""
        if not self._rank:
            return set()
        if self._regex is None:
            self._regex = re.compile(f"(?=({_trie_pattern(self._by_prefix)}))")
        found: set[str] = set()
        for longest in set(self._regex.findall(text)):
            found.update(self._starting_with_prefix_of(longest))
        return found

    def _starting_with_prefix_of(self, head: str) -> tuple[str, ...]:
        tokens = self._candidates.get(head)
        if tokens is None:
            tokens = tuple(t for k in range(1, len(head) + 1) for t in self._by_prefix.get(head[:k], ()))
            self._candidates[head] = tokens
        return tokens


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of `words` that starts at the current position."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Greedy optional tail: a longer word is preferred, a shorter one is the fallback.
        return f"(?:{body})?" if "" in node else body

    return emit(trie)
