"""One sequence's progress through its grammar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import xgrammar


@dataclass(frozen=True)
class ForbiddenTokens:
    """The tokens xgrammar never allows for one tokenizer view (its special tokens, including the
    logit columns past the tokenizer), and the bitmask row that forbids exactly those. One per
    compiler, shared by its matchers."""
    token_ids: torch.Tensor  # int64, CPU
    row_bytes: bytes  # the int32 bitmask row with only these bits cleared

    @classmethod
    def of(cls, info: xgrammar.TokenizerInfo) -> ForbiddenTokens:
        stop = set(info.stop_token_ids)  # allowed wherever the grammar may end
        ids = sorted(t for t in info.special_token_ids if t not in stop and t < info.vocab_size)
        row = np.full(-(-info.vocab_size // 32), 0xFFFFFFFF, dtype=np.uint32)
        idx = np.array(ids, dtype=np.int64)
        np.bitwise_and.at(row, idx // 32, ~(np.uint32(1) << (idx % 32).astype(np.uint32)))
        return cls(torch.tensor(ids, dtype=torch.long), row.view(np.int32).tobytes())


class SequenceGrammar:
    """Wraps an xgrammar matcher: which tokens may come next, and the tokens accepted so far.

    Only accepted (sampled and kept) tokens advance it, and a preempted sequence keeps its output
    tokens, so recomputation never needs a rollback. Sequences made with `n > 1` each get their
    own, all from one compiled grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, forbidden: ForbiddenTokens | None = None) -> None:
        self._matcher = matcher
        self.forbidden = forbidden

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (one bit per token id). False when
        every token is allowed (the row then needs no mask)."""
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the state is then
        unchanged)."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is finished."""
        return self._matcher.is_terminated()
