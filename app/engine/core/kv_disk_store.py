"""Files of the KV disk tier: one file per token block, named by its key, written off the step
thread, read back only when every check passes, and kept under a byte budget by last use.

A file is a header (magic, format version, the namespace digest, the block's key, the payload's
length and CRC-32) and the payload. It is written under a temporary name and renamed into place, so
a reader sees a whole file or none; one that fails a check (truncated, flipped bits, another model
or format, a temporary file a dead process left) is removed and never used. Several processes may
share the directory: names are content keys, renames are atomic, whoever writes enforces the budget
over what is on disk (oldest modification time first: a read touches its file), and a file that
vanishes under a reader is a miss. A full disk turns the tier off, with one warning.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import queue
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"LBKV"
VERSION = 1
HEADER = struct.Struct("<4sI32s32sQI")  # magic, version, namespace digest, key, payload bytes, crc32
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # a temporary file this old belongs to a write that will never finish
EVICT_TO = 0.9  # over budget, evict down to this fraction of it: rescans stay rare
# Other processes' writes are seen by re-reading the directory after this fraction of the budget was
# written here: the budget holds up to that much per writer between looks.
RESCAN_EVERY = 1 / 16
READERS = 4  # threads reading a restored prefix's files


@dataclass(frozen=True)
class DiskStoreCounters:
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_dropped: int = 0  # not written: the write queue was full
    files_rejected: int = 0  # failed a check and were removed
    files_evicted: int = 0


class KVDiskStore:
    def __init__(self, directory: str | os.PathLike, budget_bytes: int, namespace: bytes,
                 max_queued_bytes: int = 256 << 20) -> None:
        self.dir = Path(directory).expanduser()
        self.budget = budget_bytes
        self.namespace = hashlib.sha256(namespace).digest()
        self.max_queued_bytes = max_queued_bytes
        self.reason: str | None = None  # why the tier is off; None while on
        self._index: dict[str, int] = {}  # file name -> bytes, of files known to be on disk
        # Of those, the ones this process wrote or read whole: the others are written again when
        # their block is computed (a damaged file nobody read is replaced, not kept).
        self._verified: set[str] = set()
        self._lock = threading.Lock()  # _index, the counters, _queued_bytes
        self._queued_bytes = 0
        self._unscanned = 0  # bytes written since the directory was last read (writer thread)
        self._counts = dict.fromkeys(DiskStoreCounters.__dataclass_fields__, 0)
        self._queue: queue.Queue[tuple[bytes, memoryview] | None] = queue.Queue()
        self._tmp_ids = itertools.count()
        self._readers: ThreadPoolExecutor | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan(remove_stale=True)
        except OSError as e:
            self.reason = f"cannot use {self.dir}: {e.strerror or e}"
            return
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    @property
    def enabled(self) -> bool:
        return self.reason is None

    # ---- names and keys -------------------------------------------------------------------------
    def _key(self, digest: bytes) -> bytes:
        return hashlib.sha256(self.namespace + digest).digest()

    def _name(self, key: bytes) -> str:
        return key.hex()[:48] + SUFFIX

    def contains(self, digest: bytes) -> bool:
        """Whether a block is on disk, as far as a look can tell (another process may remove it)."""
        if not self.enabled:
            return False
        name = self._name(self._key(digest))
        with self._lock:
            if name in self._index:
                return True
        try:
            size = (self.dir / name).stat().st_size  # written by another process
        except OSError:
            return False
        with self._lock:
            self._index[name] = size
        return True

    # ---- writing --------------------------------------------------------------------------------
    def wants(self, digest: bytes, nbytes: int) -> bool:
        """Whether `put` of a block this size would be taken: the tier is on, the block is not on
        disk yet and the queue has room. Asked before copying the block out of the pool."""
        if not self.enabled or nbytes + HEADER.size > self.budget:
            return False
        with self._lock:
            if self._name(self._key(digest)) in self._verified:
                return False
            if self._queued_bytes + nbytes > self.max_queued_bytes:
                self._counts["blocks_dropped"] += 1
                return False
        return True

    def put(self, digest: bytes, payload: memoryview) -> None:
        """Queue a block for writing (its payload is not touched by the caller again)."""
        with self._lock:
            self._queued_bytes += payload.nbytes
        self._queue.put((self._key(digest), payload))

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        if hasattr(self, "_writer"):
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if hasattr(self, "_writer") and self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, payload = item
            try:
                if self.enabled:
                    self._write(key, payload)
            except Exception:  # noqa: BLE001 - a failed write costs that block, never the engine
                log.exception("KV disk tier: writing a block failed")
            finally:
                with self._lock:
                    self._queued_bytes -= payload.nbytes
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: bytes, payload: memoryview) -> None:
        name = self._name(key)
        header = HEADER.pack(MAGIC, VERSION, self.namespace, key, payload.nbytes, zlib.crc32(payload))
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{next(self._tmp_ids)}-{name}"
        size = len(header) + payload.nbytes
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.dir / name)
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._turn_off(f"the disk is full ({self.dir})")
            elif e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                self._turn_off(f"cannot write to {self.dir}: {e.strerror}")
            else:
                raise
            return
        with self._lock:
            self._index[name] = size
            self._verified.add(name)
            self._counts["blocks_written"] += 1
            self._counts["bytes_written"] += size
            total = sum(self._index.values())
        self._unscanned += size
        if self._unscanned > self.budget * RESCAN_EVERY:  # others' writes count against the budget too
            total = sum(size for _, _, size in self._scan())
        if total > self.budget:
            self._evict()

    def _turn_off(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.warning("KV disk tier off: %s", reason)

    # ---- reading --------------------------------------------------------------------------------
    def get(self, digest: bytes) -> bytearray | None:
        """A block's payload, if its file is whole and this namespace's (see `read_into`)."""
        name = self._name(self._key(digest))
        try:
            size = os.stat(self.dir / name).st_size - HEADER.size
        except OSError:
            self._forget(name)
            return None
        out = bytearray(max(size, 0))
        return out if self.read_into(digest, memoryview(out)) else None

    def read_into(self, digest: bytes, out: memoryview) -> bool:
        """Read a block's payload straight into `out` (its size is the payload's). False (`out`
        garbage): not on disk, or its file failed a check (wrong size, header, namespace, key or
        CRC-32) and was removed. A hit touches the file (its last use, for the budget)."""
        if not self.enabled:
            return False
        key = self._key(digest)
        name = self._name(key)
        path = self.dir / name
        header = bytearray(HEADER.size)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                whole = size == HEADER.size + out.nbytes and f.readinto(header) == HEADER.size \
                    and _read_fully(f, out)
        except OSError:
            self._forget(name)
            return False
        if not whole or not self._check(header, key, out):
            log.warning("KV disk tier: removed %s (truncated, corrupt or not this model's)", name)
            _unlink(path)
            self._forget(name)
            with self._lock:
                self._counts["files_rejected"] += 1
            return False
        try:
            os.utime(path)  # a read is a use: the LRU order is the files' modification times
        except OSError:
            pass  # gone since it was read (another process evicted it): the bytes read are whole
        with self._lock:
            self._index[name] = size
            self._verified.add(name)
            self._counts["blocks_read"] += 1
            self._counts["bytes_read"] += size
        return True

    def read_many(self, digests: list[bytes], rows: list[memoryview]) -> list[bool]:
        """`read_into` of each into its row, on reader threads (file reads and CRCs release the GIL)."""
        if len(digests) <= 1:
            return list(map(self.read_into, digests, rows))
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-reader")
        return list(self._readers.map(self.read_into, digests, rows))

    def _check(self, header: bytearray, key: bytes, payload: memoryview) -> bool:
        magic, version, namespace, file_key, length, crc = HEADER.unpack_from(header)
        return ((magic, version, namespace, file_key, length) == (MAGIC, VERSION, self.namespace, key, payload.nbytes)
                and zlib.crc32(payload) == crc)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._index.pop(name, None)
            self._verified.discard(name)

    # ---- the budget -----------------------------------------------------------------------------
    def _scan(self, remove_stale: bool = False) -> list[tuple[float, str, int]]:
        """Re-read the directory (other processes write and evict too): the index, and the files
        as (last use, name, bytes). Temporary files of dead writers go."""
        files: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.dir) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed meanwhile
                if entry.name.startswith(TMP_PREFIX):
                    if remove_stale and _is_stale(entry.name, now - st.st_mtime):
                        _unlink(Path(entry.path))
                elif entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, entry.name, st.st_size))
        with self._lock:
            self._index = {name: size for _, name, size in files}
            self._verified &= self._index.keys()
        self._unscanned = 0
        return files

    def _evict(self) -> None:
        files = sorted(self._scan())
        total = sum(size for _, _, size in files)
        target = self.budget * EVICT_TO
        for _, name, size in files:
            if total <= target:
                break
            _unlink(self.dir / name)
            self._forget(name)
            total -= size
            with self._lock:
                self._counts["files_evicted"] += 1

    def clear(self) -> tuple[int, int]:
        """Remove every block file (of any model) from the directory; returns (files, bytes) removed."""
        n = nbytes = 0
        for _, name, size in self._scan():
            if _unlink(self.dir / name):
                n, nbytes = n + 1, nbytes + size
            self._forget(name)
        return n, nbytes

    # ---- figures --------------------------------------------------------------------------------
    def counters(self) -> DiskStoreCounters:
        with self._lock:
            return DiskStoreCounters(**self._counts)

    @property
    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(self._index.values())

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._index)


def _is_stale(tmp_name: str, age_s: float) -> bool:
    """A temporary file whose writer is gone (its pid is not running) or that is old."""
    if age_s > STALE_TMP_S:
        return True
    try:
        pid = int(tmp_name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _read_fully(f, out: memoryview) -> bool:  # noqa: ANN001 - an unbuffered binary file
    """Fill `out` from `f`; False when the file ends first."""
    done = 0
    while done < out.nbytes:
        n = f.readinto(out[done:])
        if not n:
            return False
        done += n
    return True


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
