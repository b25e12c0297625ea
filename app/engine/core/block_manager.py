"""The KV block pool: allocation with reference counts, per-sequence block tables (one per KV cache
group, `kv_cache_spec`), and automatic prefix caching. Of a sequence it writes only its block
tables and block hashes; how many of its tokens are computed is the scheduler's to count.

A full block is identified by the hash of (parent block's hash, its token ids), so equal hashes
mean equal prefixes; each group keeps its own hash -> block map, since its blocks hold other
layers. When its last user frees it, a cached block keeps its hash and joins the free list at the
most-recently-used end; allocation takes from the least-recently-used end and only then forgets the
old hash. A freed block with no hash holds nothing to reuse: it goes to the front and is handed out
next, so the pages in use stay few and warm in cache instead of the pool's untouched ones. A later request with the same prefix takes the block back from the free list instead of
recomputing it.

Sliding-window groups give back the blocks that fell behind every future query's window as the
sequence advances (`free_skipped_blocks`); their table entries become `NULL_BLOCK`. A cached prefix
of k blocks is usable when the full-attention groups hold all k and each sliding group holds the
blocks the window of the first uncomputed position still reads.

Under the cache, an optional disk tier (`kv_disk_cache.KVDiskTier`) keeps full blocks in files keyed
by `block_digest`: each newly cached block is also offered to it, and before a waiting prompt is
looked up, `restore_ready` starts reading the blocks past its memory hits that are on disk into free
blocks it holds meanwhile (off the step thread: the prompt waits, the others step); once read they
are registered as cached free blocks, so the lookup finds them as it finds any other.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.engine.core.kv_disk_cache import PendingRead
from app.engine.core.sequence import Sequence
from app.engine.runtime.kv_cache_spec import NULL_BLOCK, KVCacheGroup, KVCacheSpec, live_blocks

if TYPE_CHECKING:
    from app.engine.core.kv_disk_cache import KVDiskTier


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions
        self.group = 0  # the KV cache group whose layers it holds (meaningful while it has a hash)


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


def block_digest(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The disk tier's key of a full block: sha256 of its parent's digest and its token ids, the
    same in every process (unlike `hash`)."""
    return hashlib.sha256((parent or b"") + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


@dataclass
class CachedPrefix:
    """The first `len(hashes)` blocks of a prompt, found in the cache: per group, their block ids
    (NULL_BLOCK before a sliding group's window)."""

    hashes: list[int]
    tables: list[list[int]]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def block_ids(self) -> Iterator[int]:
        return live_blocks(self.tables)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, spec: KVCacheSpec | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.spec = spec or KVCacheSpec((KVCacheGroup((0,), None),), block_size)
        if self.spec.block_size != block_size:
            raise ValueError(f"the KV cache spec has blocks of {self.spec.block_size} tokens, not {block_size}")
        self.groups = self.spec.groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: list[dict[int, int]] = [{} for _ in self.groups]  # per group: prefix hash -> block id
        self._num_cached_free = 0  # free blocks that still hold a reusable prefix
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.disk: KVDiskTier | None = None  # the disk tier under the cache; the engine sets it
        self._reads: list[PendingRead] = []  # reads from the disk tier in flight, or done and not yet applied

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

    @staticmethod
    def held_blocks(seq: Sequence) -> Iterator[int]:
        """Every pool block `seq` holds, over all groups."""
        return live_blocks(seq.block_tables)

    # ---- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached prefix of full blocks every group can serve, leaving at least the
        last token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return CachedPrefix([], [[] for _ in self.groups])
        blocks = self._prompt_blocks(seq)
        hits = [self._hits(g, blocks) for g in range(len(self.groups))]
        k = self._usable_blocks(hits, len(blocks))
        tables = [
            [h[i] if i >= self.spec.first_needed_block(group, k * self.block_size) else NULL_BLOCK for i in range(k)]
            for group, h in zip(self.groups, hits)
        ]
        return CachedPrefix([h for h, _ in blocks[:k]], tables)

    def _usable_blocks(self, hits: list[list[int | None]], num_blocks: int) -> int:
        """How many leading blocks every group serves, given each group's hits."""
        k = min((len(h) for g, h in zip(self.groups, hits) if g.sliding_window is None), default=num_blocks)
        # A sliding group needs only the blocks its window reads from position k * block_size on:
        # run[i] = cached blocks in a row ending at block i.
        runs = [_runs(h) for h in hits]
        while k > 0 and not all(
            runs[g][k - 1] >= k - self.spec.first_needed_block(group, k * self.block_size)
            for g, group in enumerate(self.groups)
            if group.sliding_window is not None
        ):
            k -= 1
        return k

    def _prompt_blocks(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(prefix hash, token ids) of each full block of `seq` but the one holding its last token."""
        blocks: list[tuple[int, tuple[int, ...]]] = []
        parent: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = block_hash(parent, tokens)
            blocks.append((parent, tokens))
        return blocks

    def _hits(self, group: int, blocks: list[tuple[int, tuple[int, ...]]]) -> list[int | None]:
        """Per prompt block, the group's cached block with that prefix (None: not cached). A full
        group stops at its first miss: later blocks cannot make a prefix without it."""
        cached = self.cached[group]
        full = self.groups[group].sliding_window is None
        hits: list[int | None] = []
        for h, tokens in blocks:
            block_id = cached.get(h)
            if block_id is not None and self.blocks[block_id].token_ids != tokens:
                block_id = None  # a hash collision
            if block_id is None and full:
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, cached: CachedPrefix, num_new_tokens: int) -> bool:
        revived = sum(1 for b in cached.block_ids() if self.blocks[b].ref_count == 0)
        end = cached.num_blocks * self.block_size + num_new_tokens
        needed = len(self.groups) * max(0, self.blocks_needed(end) - cached.num_blocks)
        return needed + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: CachedPrefix) -> int:
        """Give a waiting sequence its cached prefix blocks (it computes the rest). Returns how many
        of its tokens they hold: the scheduler counts them computed."""
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += min(cached.num_blocks * self.block_size, seq.num_prompt_tokens)
        from_disk = sum(1 for i in seq.disk_blocks if i < cached.num_blocks) * self.block_size
        seq.num_disk_cached_tokens = min(from_disk, seq.num_prompt_tokens)
        seq.disk_blocks = set()
        if self.disk is not None:
            self.disk.num_tokens_restored += seq.num_disk_cached_tokens
        for block_id in cached.block_ids():
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
        seq.block_tables = [list(table) for table in cached.tables]
        seq.block_hashes = list(cached.hashes)
        return cached.num_blocks * self.block_size

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._new_blocks_needed(seq, num_new_tokens) * len(self.groups) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow every group's block table to hold `num_computed_tokens + num_new_tokens` tokens
        (all groups' tables have one length; sliding ones are NULL_BLOCK before their window)."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
        for _ in range(self._new_blocks_needed(seq, num_new_tokens)):
            for table in seq.block_tables:
                table.append(self._take_free_block())

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Per group."""
        held = len(seq.block_tables[0]) if seq.block_tables else 0
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - held)

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._num_cached_free -= 1
            if self.cached[block.group].get(block.hash) == block_id:
                del self.cached[block.group][block.hash]
        block.hash, block.token_ids, block.ref_count = None, None, 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:  # nothing to reuse in it: handed out next, while its pages are warm
                self.free.move_to_end(block_id, last=False)
            self._num_cached_free += block.hash is not None

    def free_seq(self, seq: Sequence) -> None:
        """Return a sequence's blocks (the scheduler then counts none of its tokens computed). Tail
        blocks go in first so they are evicted before the shared head of the prefix, which other
        requests are more likely to reuse."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = []
        seq.block_hashes = []

    def free_rejected_blocks(self, seq: Sequence) -> None:
        """Give back the blocks reserved for drafts the verifier rejected: those past the block
        holding the sequence's last token (they hold no hash, so nothing unverified is cached)."""
        keep = self.blocks_needed(seq.num_tokens)
        for table in seq.block_tables:
            while len(table) > keep:
                block_id = table.pop()
                if block_id != NULL_BLOCK:
                    self._release(block_id)

    def free_skipped_blocks(self, seq: Sequence) -> None:
        """Give back the sliding groups' blocks before the window of the next position computed:
        no later query of this sequence reads them. Cached ones stay reusable until evicted."""
        for group, table in zip(self.groups, seq.block_tables):
            first = self.spec.first_needed_block(group, seq.num_computed_tokens)
            for i in range(min(first, len(table))):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                    table[i] = NULL_BLOCK

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching or not seq.block_tables:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_tables[0]))
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        to_save: list[tuple[bytes, list[int]]] = []
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(seq.block_tables):
                if table[i] == NULL_BLOCK:
                    continue
                block = self.blocks[table[i]]
                if block.hash is None and h not in self.cached[g]:
                    block.hash, block.token_ids, block.group = h, tokens, g
                    self.cached[g][h] = block.block_id
            if disk is not None and all(table[i] != NULL_BLOCK for table in seq.block_tables):
                to_save.append((self._digests(seq, i + 1)[i], [table[i] for table in seq.block_tables]))
        if to_save:
            disk.save(to_save)

    # ---- the disk tier ----------------------------------------------------------------------
    def _digests(self, seq: Sequence, n: int) -> list[bytes]:
        """`seq`'s block digests, extended to its first `n` blocks."""
        d, bs = seq.block_digests, self.block_size
        while len(d) < n:
            i = len(d)
            d.append(block_digest(d[-1] if d else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return d

    def restore_ready(self, seq: Sequence) -> bool:
        """Whether `seq` may be looked up in the cache now: no read of its prefix from disk is in
        flight. Starts one (False) when blocks past its memory hits are on disk; once it is done,
        its blocks are cached free blocks, found by the lookup as any other (True)."""
        read = seq.disk_read
        if read is None:
            return not self._start_restore(seq)
        if not read.future.done():
            return False
        seq.disk_read = None
        seq.disk_blocks.update(self._finish_restore(read))
        return True

    def _start_restore(self, seq: Sequence) -> bool:
        """Set aside free blocks for the blocks that extend `seq`'s cached prefix from disk (those on
        disk in a row past the memory hits, and the sliding groups' window there), pin the memory
        hits the longer prefix uses, and start reading. Only when they fit beside the memory hits;
        False when there is nothing to read."""
        disk = self.disk
        if disk is None or not disk.enabled or not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        blocks = self._prompt_blocks(seq)
        hits = [self._hits(g, blocks) for g in range(len(self.groups))]
        k = self._usable_blocks(hits, len(blocks))
        if k == len(blocks):
            return False
        digests = self._digests(seq, len(blocks))
        end = k
        while end < len(blocks) and disk.contains(digests[end]):
            end += 1
        if end == k:
            return False
        wanted: dict[int, list[int]] = {}  # block index -> groups to read it into
        kept: list[int] = []  # memory hits the longer prefix uses
        for g, group in enumerate(self.groups):
            for i in range(self.spec.first_needed_block(group, end * self.block_size), end):
                b = hits[g][i] if i < len(hits[g]) else None
                if b is None:
                    wanted.setdefault(i, []).append(g)
                else:
                    kept.append(b)
        if any(i < k and not disk.contains(digests[i]) for i in wanted):
            return False
        kept_free = sum(1 for b in set(kept) if self.blocks[b].ref_count == 0)
        if sum(map(len, wanted.values())) + kept_free + len(self.groups) > self.num_free_blocks:
            return False
        for b in kept:  # held until the read is done: nothing evicts them meanwhile
            self._hold(b)
        order = sorted(wanted)
        dest: dict[int, tuple[list[int], list[int]]] = {}
        for r, i in enumerate(order):
            for g in wanted[i]:
                rows, ids = dest.setdefault(g, ([], []))
                rows.append(r)
                ids.append(self._take_free_block())  # held (ref 1, no hash) until the read is done
        future = disk.load([digests[i] for i in order], dest)
        seq.disk_read = PendingRead(future, [blocks[i] for i in order], order, dest, kept)
        self._reads.append(seq.disk_read)
        return True

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
            self._num_cached_free -= 1
        block.ref_count += 1

    def _finish_restore(self, read: PendingRead) -> list[int]:
        """Register the blocks a done read put in place as cached and give every block it held back
        (then cached free blocks). Returns the prompt block indices it restored."""
        self._reads.remove(read)
        result = read.future.result()
        self.disk.copy_into_pool(result)
        n = result.num_blocks
        for g, (rows, ids) in read.dest.items():
            for r, b in zip(rows, ids):
                h, tokens = read.blocks[r]
                if r < n and h not in self.cached[g]:
                    block = self.blocks[b]
                    block.hash, block.token_ids, block.group = h, tokens, g
                    self.cached[g][h] = b
                self._release(b)
        for b in read.kept:
            self._release(b)
        return read.indices[:n]

    def reap_reads(self) -> None:
        """Finish the done reads of sequences that ended while waiting on them (their blocks are
        still worth caching)."""
        for read in [r for r in self._reads if r.orphan and r.future.done()]:
            self._finish_restore(read)

    def finish_reads(self) -> None:
        """Wait for every read from disk and apply it (the engine is closing)."""
        for read in list(self._reads):
            read.future.result()
            read.orphan = True
        self.reap_reads()

    def wait_reads(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a read from disk to finish: for a step with nothing else to do."""
        if self._reads:
            wait([r.future for r in self._reads], timeout_s, FIRST_COMPLETED)

    @property
    def num_pending_reads(self) -> int:
        return len(self._reads)

    def drop_read(self, seq: Sequence) -> None:
        """`seq` ended while its prefix was being read: the read finishes without it."""
        if seq.disk_read is not None:
            seq.disk_read.orphan = True
            seq.disk_read = None


def _runs(hits: list[int | None]) -> list[int]:
    """runs[i]: how many blocks in a row up to and including i are cached."""
    runs, run = [], 0
    for block_id in hits:
        run = run + 1 if block_id is not None else 0
        runs.append(run)
    return runs
