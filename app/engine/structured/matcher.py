"""One sequence's progress through its grammar."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import xgrammar


class SequenceGrammar:
    """Wraps an xgrammar matcher: which tokens may come next, and the tokens accepted so far.

    Only accepted (sampled and kept) tokens advance it, and a preempted sequence keeps its output
    tokens, so recomputation never needs a rollback. Sequences made with `n > 1` each get their
    own, all from one compiled grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (one bit per token id)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the state is then
        unchanged)."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is finished."""
        return self._matcher.is_terminated()
