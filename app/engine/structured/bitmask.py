"""The step's grammar mask: one bitmask for every constrained row, applied in one batched op."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from app.engine.types.batch import ScheduledSequence


class GrammarBitmask:
    """Owned by the sampler. `apply` sets the logits of tokens a row's grammar forbids to -inf,
    in place, for the constrained rows only: unconstrained rows are not read or written, so their
    tokens are the same as without constrained neighbours (batch invariance).

    `vocab_size` is the logits' width; the matchers' tokenizer view has the same width, so the
    columns past the tokenizer's vocabulary are masked out like any forbidden token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = -(-vocab_size // 32)  # one bit per token, 32 to an int32
        self._host: torch.Tensor | None = None  # reused across steps, grown to the largest batch

    def apply(self, logits: torch.Tensor, seqs: list[ScheduledSequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return
        import xgrammar as xgr  # loaded already: the constrained requests compiled with it

        bitmask = self._buffer(len(seqs), logits.device)
        for i in rows:
            seqs[i].grammar.fill_bitmask(bitmask, i)
        bitmask = bitmask[: len(seqs)]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def _buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            # Pinned when the logits live on a GPU, so the upload does not wait for the copy.
            pin = device.type == "cuda"
            self._host = torch.empty((num_rows, self._words), dtype=torch.int32, pin_memory=pin)
        return self._host
