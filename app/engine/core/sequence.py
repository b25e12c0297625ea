"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from app.engine.runtime.kv_cache_spec import live_blocks
from app.engine.types.outputs import TopLogprobs
from app.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from app.engine.core.kv_disk_cache import PendingRead
    from app.engine.structured.matcher import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output so far), how many of them have KV in the cache
    (`num_computed_tokens`), and the blocks holding that KV (`block_tables`, one per KV cache group).

    The scheduler needs no prefill/decode flag: each step a sequence contributes
    `num_tokens - num_computed_tokens` tokens (or a chunk of them). A sequence samples when its
    step reaches the end of its tokens; a preempted one simply starts over from zero."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        # A plain attribute, not a property: the step loop reads it several times per sequence.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at (last) admission
        # One block table per KV cache group (`kv_cache_spec`), all of one length; empty while the
        # sequence holds no blocks.
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[int] = []  # prefix hash of each full block, in order
        # The KV disk tier: the stable key of each full block's token chain (tokens only grow, so
        # they stay valid), which blocks were read from disk for it, and of the prompt tokens the
        # prefix cache served at (last) admission, how many came from disk.
        self.block_digests: list[bytes] = []
        self.disk_blocks: set[int] = set()
        self.disk_read: PendingRead | None = None  # its prefix's blocks being read from disk
        self.num_disk_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.prompt_logprobs: list[TopLogprobs | None] = []
        self.logprobs: list[TopLogprobs] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        # Structured output: the grammar's state, advanced by each kept token; None when the output
        # is free, and again once the request has finished.
        self.grammar: SequenceGrammar | None = None
        # Speculative decoding: this step's drafted tokens, verified after `token_ids` (not part of
        # them until kept), and how many tokens have a draft model's KV in its pool.
        self.spec_token_ids: list[int] = []
        self.num_draft_computed = 0

    @property
    def block_table(self) -> list[int]:
        """The first group's block table: the only one of a model without sliding-window layers."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        n = len(self.token_ids)
        return n > self.num_prompt_tokens and n - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={sum(1 for _ in live_blocks(self.block_tables))}, {self.status.value})"
        )
