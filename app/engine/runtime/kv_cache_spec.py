"""Which layers share a block table (KV cache groups), and what a sequence costs in pool blocks.

After vLLM's hybrid KV cache manager. Full-attention layers keep every token; a sliding-window
layer never reads a key older than its window, so its group keeps only the blocks covering the last
`sliding_window` positions and gives older ones back as the sequence grows. Each group has its own
block table per sequence.

The layers are split into groups of equal size, so a pool block ("page") holds `block_size` tokens
of `layers_per_block` layers whichever group holds it: one pool, and any free block serves any
group. Slot j of a page is pool tensor j; layer l reads pool tensor `slot` of its group's pages.
Gemma 3 270M (3 full and 15 sliding layers): one full group and five sliding groups of 3 layers.
Where the counts do not divide, the last group of a kind has fewer layers and leaves the rest of its
pages unused; a model of one kind has a single group of all layers, as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from app.engine.gguf.model_config import ModelConfig

NULL_BLOCK = -1  # a block-table entry before a sliding group's window: no kernel reads it


def live_blocks(tables: list[list[int]]) -> Iterator[int]:
    """The pool blocks in per-group block tables, skipping entries a sliding window left behind."""
    return (b for table in tables for b in table if b != NULL_BLOCK)


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    sliding_window: int | None  # None: full attention, every block is kept


@dataclass(frozen=True)
class LayerSlot:
    group: int  # which block table the layer's attention reads
    slot: int  # which pool tensor holds its K/V inside a page


@dataclass(frozen=True)
class KVCacheSpec:
    groups: tuple[KVCacheGroup, ...]
    block_size: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_block(self) -> int:
        return max(len(g.layers) for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether some group frees blocks behind a sliding window."""
        return any(g.sliding_window is not None for g in self.groups)

    def layer_slots(self) -> list[LayerSlot]:
        """Indexed by layer."""
        slots = {layer: LayerSlot(g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layers)}
        return [slots[layer] for layer in range(len(slots))]

    def first_needed_block(self, group: KVCacheGroup, num_computed: int) -> int:
        """The first block a query at position `num_computed` (the next one computed) may read:
        keys p - W < k <= p in a window of W."""
        if group.sliding_window is None:
            return 0
        return max(0, num_computed - group.sliding_window + 1) // self.block_size

    def window_blocks(self, group: KVCacheGroup, chunk: int = 1) -> int | None:
        """Most blocks a sequence holds in `group` while it computes `chunk` tokens at once (1: a
        decode): the W - 1 keys before the chunk and the chunk may straddle one more block than
        they fill. None: unbounded (full attention)."""
        if group.sliding_window is None:
            return None
        return (group.sliding_window + chunk - 2) // self.block_size + 2

    def blocks_for_tokens(self, num_tokens: int, chunk: int = 1) -> int:
        """Blocks a sequence of `num_tokens` tokens holds over all groups, computing `chunk` tokens
        a step."""
        per_group = -(-num_tokens // self.block_size)
        return sum(min(per_group, self.window_blocks(g, chunk) or per_group) for g in self.groups)

    def max_tokens(self, num_blocks: int, chunk: int = 1) -> int:
        """The longest sequence `num_blocks` pool blocks can hold on their own."""
        lo, hi = 0, num_blocks * self.block_size  # one group of one block per block_size tokens at best
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_for_tokens(mid, chunk) <= num_blocks else (lo, mid - 1)
        return lo

    def growing_groups(self, num_tokens: int) -> int:
        """Groups that take a new block every `block_size` tokens for a sequence at `num_tokens`:
        a sliding group stops growing once it holds its window."""
        per_group = -(-num_tokens // self.block_size)
        return sum(1 for g in self.groups if g.sliding_window is None or per_group < self.window_blocks(g))


def kv_cache_spec(cfg: ModelConfig, block_size: int, hybrid: bool = True) -> KVCacheSpec:
    """The model's KV cache groups. `hybrid=False` (vLLM's --disable-hybrid-kv-cache-manager) keeps
    one group of all layers that frees nothing, every layer holding every token."""
    layers = range(cfg.num_layers)
    by_window: dict[int | None, list[int]] = defaultdict(list)
    for layer in layers:
        by_window[cfg.layer_window(layer) if hybrid else None].append(layer)
    size = min(len(members) for members in by_window.values())
    groups = [
        KVCacheGroup(tuple(members[i : i + size]), window)
        for window, members in sorted(by_window.items(), key=lambda kv: kv[0] is not None)  # full groups first
        for i in range(0, len(members), size)
    ]
    return KVCacheSpec(tuple(groups), block_size)
