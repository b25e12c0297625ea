"""The KV block pool: allocation with reference counts, per-sequence block tables, and automatic
prefix caching.

A full block is identified by the hash of (parent block's hash, its token ids), so equal hashes
mean equal prefixes. When its last user frees it, a cached block keeps its hash and joins the free
list at the most-recently-used end; allocation takes from the least-recently-used end and only
then forgets the old hash. A later request with the same prefix takes the block back from the free
list instead of recomputing it.
"""

from __future__ import annotations

from collections import OrderedDict

from app.engine.core.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # prefix hash -> block id
        self._num_cached_free = 0  # free blocks that still hold a reusable prefix
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of full blocks, leaving at least the last token
        to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        parent: int | None = None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return needed + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks (it computes the rest)."""
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += min(len(cached) * self.block_size, seq.num_prompt_tokens)
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold `num_computed_tokens + num_new_tokens` tokens."""
        for _ in range(self._new_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._num_cached_free -= 1
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, None, 1
        return block_id

    def free_seq(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Tail blocks go in first so they are evicted before the shared
        head of the prefix, which other requests are more likely to reuse."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self._num_cached_free += block.hash is not None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
