"""One step's batch as the scheduler hands it to the runtime: which sequences run and how many
tokens each computes. The runtime reads a sequence only through `ScheduledSequence` (core's
`Sequence` is one) and returns what it computed; it never writes to one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from app.engine.types.outputs import TopLogprobs
from app.engine.types.sampling_params import SamplingParams


class ScheduledSequence(Protocol):
    request_id: str
    token_ids: list[int]  # prompt + verified output
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache
    block_tables: list[list[int]]  # one per KV cache group
    params: SamplingParams
    grammar: Any  # the structured-output matcher (`structured.matcher.SequenceGrammar`); None when free
    spec_token_ids: list[int]  # this step's drafts, verified after `token_ids`
    prompt_logprobs: list[TopLogprobs | None]  # recorded so far (the runtime reads how many)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class ScheduledBatch:
    seqs: list[Any] = field(default_factory=list)  # ScheduledSequence; core's Sequence in the engine
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    preempted: list[Any] = field(default_factory=list)
    num_decode_tokens: int = 0  # rows of decoding sequences (their verify positions included)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def add(self, seq: ScheduledSequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
