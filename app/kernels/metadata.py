"""The attention metadata of one packed step, shared by the kernel dispatch, the torch references
and the Triton launchers. Plain torch: the CPU path imports it without Triton or CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# eq=False: identity semantics; comparing tensors field by field is neither cheap nor a bool.
@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """vLLM's names. Sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, the last tokens
    of a context of `seq_lens[i]` tokens whose KV lives in the blocks `block_table[i]`; token t's new
    key/value goes to cache slot `slot_mapping[t]` (slot = block_id * block_size + offset).

    Only references: a CUDA graph records the addresses of the tensors its kernels read, so the
    metadata of a graphed step views the graph's static buffers, and making one per step is cheap."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, -1 = padding; None if nothing is stored
    # Every layer of a step attends with the same metadata: values derived from it (the CPU
    # reference's decode gather plan) are made once and kept here. Each step makes a new object,
    # so they never outlive the values they were derived from.
    derived: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionMetadata:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        slots = None if self.slot_mapping is None else move(self.slot_mapping)
        return AttentionMetadata(move(self.cu_seqlens_q), move(self.seq_lens), move(self.block_table), slots)
