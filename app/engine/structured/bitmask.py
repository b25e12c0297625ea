"""The step's grammar mask: one bitmask for every constrained row, applied in one batched op."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from app.engine.structured.matcher import ForbiddenTokens
    from app.engine.types.batch import ScheduledSequence


class GrammarBitmask:
    """Owned by the sampler. `apply` sets the logits of tokens a row's grammar forbids to -inf,
    in place, for the constrained rows only: unconstrained rows are not read or written, so their
    tokens are the same as without constrained neighbours (batch invariance).

    Most constrained steps are free text (a tool grammar before `<tool_call>`), where the mask
    forbids at most the tokenizer's special tokens: such rows get those few ids filled with -inf
    instead of the full bitmask (the same logits), and rows that allow every token get nothing.

    `vocab_size` is the logits' width; the matchers' tokenizer view has the same width, so the
    columns past the tokenizer's vocabulary are masked out like any forbidden token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = -(-vocab_size // 32)  # one bit per token, 32 to an int32
        self._host: torch.Tensor | None = None  # reused across steps, grown to the largest batch
        self._host_np: np.ndarray | None = None  # the same memory, for byte compares without torch ops
        self._ids: tuple[ForbiddenTokens, torch.Tensor] | None = None  # the last ids, on the logits' device
        self.full_applies = 0  # counters: what the steps needed (tests and profiles read them)
        self.special_fills = 0

    def apply(self, logits: torch.Tensor, seqs: list[ScheduledSequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return
        bitmask = self._buffer(len(seqs), logits.device)
        full: list[int] = []
        special: list[int] = []
        forbidden = seqs[rows[0]].grammar.forbidden  # one compiler's: the same for every row
        for i in rows:
            grammar = seqs[i].grammar
            if not grammar.fill_bitmask(bitmask, i):
                continue  # every token allowed
            if grammar.forbidden is forbidden is not None and self._host_np[i].tobytes() == forbidden.row_bytes:
                special.append(i)
            else:
                full.append(i)
        if special:
            self._fill_forbidden(logits, special, forbidden)
        if full:
            self._apply_full(logits, bitmask, len(seqs), full)

    def _fill_forbidden(self, logits: torch.Tensor, rows: list[int], forbidden: ForbiddenTokens) -> None:
        self.special_fills += 1
        if self._ids is None or self._ids[0] is not forbidden or self._ids[1].device != logits.device:
            self._ids = (forbidden, forbidden.token_ids.to(logits.device))
        ids = self._ids[1]
        if len(rows) == 1:
            logits[rows[0]].index_fill_(0, ids, float("-inf"))
        else:
            logits[torch.tensor(rows, device=logits.device)[:, None], ids] = float("-inf")

    def _apply_full(self, logits: torch.Tensor, bitmask: torch.Tensor, num_rows: int, rows: list[int]) -> None:
        import xgrammar as xgr  # loaded already: the constrained requests compiled with it

        self.full_applies += 1
        bitmask = bitmask[:num_rows]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def _buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            # Pinned when the logits live on a GPU, so the upload does not wait for the copy.
            pin = device.type == "cuda"
            self._host = torch.empty((num_rows, self._words), dtype=torch.int32, pin_memory=pin)
            self._host_np = self._host.numpy()
        return self._host
