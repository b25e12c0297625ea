"""Prompt lookup: the tokens that followed the last earlier occurrence of the context's suffix.

Each sequence keeps an index {n-gram: where it last ended} for every n in [min, max], grown by the
tokens added since its last proposal, so a proposal costs a few dict lookups, not a scan of the
context.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from app.engine.core.sequence import Sequence


class _Index:
    __slots__ = ("ends", "num_indexed")

    def __init__(self, sizes: range) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.num_indexed = 0  # n-grams ending before this position are in `ends`


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._indexes: WeakKeyDictionary[Sequence, _Index] = WeakKeyDictionary()  # dies with its sequence

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens continuing `seq` as its context continued after the longest suffix seen
        before (the most recent occurrence); [] when none recurs."""
        tokens = seq.token_ids
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _Index(self.sizes)
        self._grow(index, tokens, len(tokens) - 1)  # the suffix itself must not match itself
        for n in reversed(self.sizes):
            if n > len(tokens):
                continue
            end = index.ends[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []

    def _grow(self, index: _Index, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [num_indexed, upto)."""
        for end in range(index.num_indexed, upto):
            for n, ends in index.ends.items():
                if end + 1 >= n:
                    ends[tuple(tokens[end + 1 - n : end + 1])] = end
        index.num_indexed = max(index.num_indexed, upto)
