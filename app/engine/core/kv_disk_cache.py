"""The KV disk tier under the prefix cache: full blocks the prefix cache holds are also written to a
directory, and a prompt whose prefix misses in memory reads them back into the pool instead of
recomputing them (after a restart, or once other work evicted them; docs/kv-cache.md).

A block is keyed by a stable content hash of its token chain (`block_manager.block_digest`: sha256 of the parent's
digest and its token ids) inside a namespace of everything that changes its bytes: the model file,
the compute and KV dtypes, the pool's layout and the kernels that computed it (`namespace`). A file
holds one token block of every layer, so it serves any grouping of the layers.

Writing copies the step's new full blocks out of the pool on the step thread (one gather per pool
tensor) into a buffer the writer thread owns. Reading happens on a loader thread: the files of a
prefix are read in parallel straight into one buffer, checked, and scattered into pool blocks the
block manager set aside for them, while the step thread keeps stepping the other sequences. Pinning the block until written instead would put a
second thread's state into the block manager's free list; a copy leaves the pool's owner alone.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app import __version__
from app.engine.core.kv_disk_store import KVDiskStore
from app.engine.runtime.kv_pool import block_nbytes, read_blocks, write_blocks
from app.engine.types.outputs import DiskTierStats

if TYPE_CHECKING:
    from app.engine.runtime.worker import Worker
    from app.engine.types.engine_config import EngineConfig
    from app.kernels import KVCacheLayer



def default_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("localbatch")) / "kv-blocks"


def model_identity(path: str | os.PathLike) -> str:
    """A GGUF file's identity: its size and a hash of its head (header, metadata, first tensors)
    and tail, so a copy or a move is the same model and a requantized one is not."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


@dataclass
class DiskRead:
    """What a `KVDiskTier.load` read: its first `num_blocks` rows whole, for the pool blocks `dest`
    names (group -> rows, pool blocks); `copied` once they are in the pool."""

    num_blocks: int
    payload: torch.Tensor
    dest: dict[int, tuple[list[int], list[int]]]
    copied: bool = False

    def copy_into(self, tier: KVDiskTier) -> None:
        if self.num_blocks:
            write_blocks(tier.kv_caches, tier.layer_groups, self.payload, self.dest)
        self.copied = True
        self.payload = self.payload[:0]  # the buffer is not needed again


class KVDiskTier:
    """The pool's side of the tier: which bytes a block is, written and read through a
    `KVDiskStore`. `reason` says why it is off (then it does nothing)."""

    def __init__(self, store: KVDiskStore | None, kv_caches: list[KVCacheLayer] | None = None,
                 layer_groups: list[int] | None = None, reason: str | None = None) -> None:
        self.store = store
        self.kv_caches = kv_caches or []
        self.layer_groups = layer_groups or []
        self.block_nbytes = block_nbytes(self.kv_caches) if self.kv_caches else 0
        self._reason = reason
        self.num_tokens_restored = 0  # prompt tokens admitted from disk-read blocks
        self.pool_on_cpu = all(t.device.type == "cpu" for layer in self.kv_caches for t in (layer.k, layer.v))
        self._loader: ThreadPoolExecutor | None = None  # reads of a prefix, one at a time

    @property
    def reason(self) -> str | None:
        return self._reason or (self.store.reason if self.store is not None else "not set up")

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def contains(self, digest: bytes) -> bool:
        return self.enabled and self.store.contains(digest)

    def save(self, blocks: list[tuple[bytes, list[int]]]) -> None:
        """Queue token blocks (digest, pool block `block_ids[g]` of each group g) for writing, those
        not on disk yet while the queue has room: copied out of the pool together."""
        if not self.enabled:
            return
        blocks = [(d, ids) for d, ids in blocks if self.store.wants(d, self.block_nbytes)]
        if not blocks:
            return
        rows = read_blocks(self.kv_caches, self.layer_groups, [ids for _, ids in blocks]).numpy()
        for r, (digest, _) in enumerate(blocks):
            self.store.put(digest, memoryview(rows[r]))  # a row keeps the whole copy alive until written

    def load(self, digests: list[bytes], dest: dict[int, tuple[list[int], list[int]]]) -> Future[DiskRead]:
        """Read these blocks from disk into pool blocks, off the step thread: `dest` maps a group to
        (rows, pool blocks), row r being `digests[r]`. The pool blocks must be held by the caller
        until the future is done; its `DiskRead` says how many leading rows are in place."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-load")
        return self._loader.submit(self._load, digests, dest)

    def _load(self, digests: list[bytes], dest: dict[int, tuple[list[int], list[int]]]) -> DiskRead:
        buf = torch.empty(len(digests), self.block_nbytes, dtype=torch.uint8)
        rows = buf.numpy()
        ok = self.store.read_many(digests, [memoryview(rows[r]) for r in range(len(digests))])
        n = ok.index(False) if False in ok else len(ok)  # a failed file ends the prefix there
        dest = {g: ([r for r in rs if r < n], [b for r, b in zip(rs, bs) if r < n]) for g, (rs, bs) in dest.items()}
        read = DiskRead(n, buf[:n], dest)
        if self.pool_on_cpu:  # copied here, beside the step; a device pool is written by the step thread
            read.copy_into(self)
        return read

    def copy_into_pool(self, read: DiskRead) -> None:
        """Called on the step thread when the read is done: the copy `_load` left for it, if any."""
        if not read.copied:
            read.copy_into(self)

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    def clear(self) -> tuple[int, int]:
        """Remove every block file of the directory: (files, bytes)."""
        return self.store.clear() if self.store is not None and self.store.dir.is_dir() else (0, 0)

    def stats(self) -> DiskTierStats:
        s = self.store
        c = s.counters() if s is not None else None
        return DiskTierStats(
            enabled=self.enabled,
            reason=self.reason or "",
            directory=str(s.dir) if s is not None else "",
            budget_bytes=s.budget if s is not None else 0,
            bytes_on_disk=s.bytes_on_disk if s is not None else 0,
            num_files=s.num_files if s is not None else 0,
            num_blocks_read=c.blocks_read if c else 0,
            num_tokens_restored=self.num_tokens_restored,
            bytes_read=c.bytes_read if c else 0,
            num_blocks_written=c.blocks_written if c else 0,
            bytes_written=c.bytes_written if c else 0,
            num_blocks_dropped=c.blocks_dropped if c else 0,
            num_files_rejected=c.files_rejected if c else 0,
            num_files_evicted=c.files_evicted if c else 0,
        )


def namespace(worker: Worker, block_size: int) -> bytes:
    """Everything besides the tokens that changes a block's bytes."""
    from app.kernels import cpu_qgemm

    cfg = worker.plan.model_config
    device = worker.setup.device
    parts = [
        f"localbatch {__version__}", f"model {model_identity(worker.model_path)}",
        f"compute {worker.setup.dtype}", f"kv {worker.kv_dtype}", f"block {block_size}",
        f"layers {cfg.num_layers} kv_heads {cfg.num_kv_heads} head_dim {cfg.head_dim}",
        f"device {device.type} {torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_qgemm.isa()}",
        f"kernels {worker.backend} {worker.model.plan.settings!r}",  # the settings the model was built with
    ]
    return "\n".join(parts).encode()


def open_disk_tier(config: EngineConfig, worker: Worker) -> KVDiskTier:
    """The engine's tier: off (with the reason) when its budget is 0, the model has random weights
    or prefix caching is off."""
    budget = config.kv_disk_cache_bytes
    if not budget:
        return KVDiskTier(None, reason="--kv-disk-cache-bytes is 0")
    if not config.enable_prefix_caching:
        return KVDiskTier(None, reason="prefix caching is off")
    if worker.model_path is None:
        return KVDiskTier(None, reason="random weights: no model file to key blocks by")
    directory = config.kv_disk_cache_dir or default_dir()
    store = KVDiskStore(directory, budget, namespace(worker, config.block_size))
    runner = worker.runner
    return KVDiskTier(store, runner.kv_caches, runner.layer_groups)


@dataclass
class PendingRead:
    """A read of a prefix's blocks from disk in flight: the pool blocks it holds (`dest`, group ->
    rows, blocks; `kept`, the memory hits it pins), and per row the prompt block (hash, tokens) and
    index it restores."""

    future: Future[DiskRead]
    blocks: list[tuple[int, tuple[int, ...]]]
    indices: list[int]
    dest: dict[int, tuple[list[int], list[int]]]
    kept: list[int]
    orphan: bool = False
