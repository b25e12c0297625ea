"""Fast read-only GGUF parser: metadata, tensor infos and zero-copy tensor bytes over one mmap.

`gguf.GGUFReader` builds a numpy view per field, which is slow on a large (262,144-entry) vocabulary;
here scalars go through `struct`, numeric arrays through one `numpy.frombuffer`, and string arrays
through a tight loop over a memoryview.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from app.engine.types.errors import GGUFError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp rejects tensors with more dimensions
MAX_ARRAY_NESTING = 8  # real files nest at most once; a bound keeps corrupt files off the recursion limit

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_SCALARS = MappingProxyType({
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
})

_ARRAY_DTYPES = MappingProxyType({
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),  # converted to numpy bool after reading
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. `shape` is in numpy/torch order (ggml dims reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _BadFile(Exception):
    """A format problem found while parsing; GGUFFile prefixes the path and re-raises GGUFError."""


class _Parser:
    """Sequential little-endian reader over the mapped bytes; every read is bounds-checked."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def _take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _BadFile(f"file is truncated: {what} runs past end of file (offset {start}, file size {self.size})")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self._take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self._take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self._take(n, what)
        return _decode(self.buf[start:start + n])

    def metadata(self, count: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(count):
            key = self.string(f"metadata key #{i}")
            if key in out:
                raise _BadFile(f"duplicate metadata key {_q(key)}")
            vtype = self.u32(f"metadata {_q(key)} type")
            out[key] = self.value(vtype, key)
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"metadata {_q(key)}")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise _BadFile(f"metadata {_q(key)} has unknown value type {vtype}")
        return fmt.unpack_from(self.buf, self._take(fmt.size, f"metadata {_q(key)}"))[0]

    def array(self, key: str, depth: int = 1) -> Any:
        itype = self.u32(f"metadata {_q(key)} array type")
        count = self.u64(f"metadata {_q(key)} array length")
        if itype == GGUFValueType.STRING:
            return self.strings(count, key)
        if itype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise _BadFile(f"metadata {_q(key)} nests arrays more than {MAX_ARRAY_NESTING} deep")
            return [self.array(key, depth + 1) for _ in range(self._bounded(count, 12, key))]
        dtype = _ARRAY_DTYPES.get(itype)
        if dtype is None:
            raise _BadFile(f"metadata {_q(key)} is an array of unknown value type {itype}")
        start = self._take(count * dtype.itemsize, f"metadata {_q(key)}")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).astype(dtype.newbyteorder("="))
        return arr.astype(np.bool_) if itype == GGUFValueType.BOOL else arr

    def _bounded(self, count: int, min_item_size: int, key: str) -> int:
        # A corrupt length must fail as truncation, not as a huge allocation.
        if count * min_item_size > self.size - self.pos:
            raise _BadFile(f"file is truncated: metadata {_q(key)} ({count} items) runs past end of file")
        return count

    def strings(self, count: int, key: str) -> list[str]:
        # The hot loop of the whole parse (262,144 tokens): locals only, one bounds check per item.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = [""] * self._bounded(count, 8, key)
        try:
            for i in range(count):
                n = unpack(buf, pos)[0]
                pos += 8 + n
                if pos > size:
                    break
                out[i] = str(buf[pos - n:pos], "utf-8", "surrogateescape")
        except struct.error:
            pos = size + 1
        if pos > size:
            raise _BadFile(f"file is truncated: metadata {_q(key)} runs past end of file")
        self.pos = pos
        return out

    def tensor_info(self, index: int) -> tuple[str, tuple[int, ...], int, int, int]:
        name = self.string(f"tensor info #{index}")
        n_dims = self.u32(f"tensor {_q(name)} info")
        if n_dims > MAX_DIMS:
            raise _BadFile(f"tensor {_q(name)} has {n_dims} dimensions (at most {MAX_DIMS} supported)")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self._take(8 * n_dims, f"tensor {_q(name)} info"))
        type_id = self.u32(f"tensor {_q(name)} info")
        rel_offset = self.u64(f"tensor {_q(name)} info")
        return name, tuple(reversed(dims)), type_id, rel_offset, _tensor_nbytes(name, dims, type_id)


def _q(text: str) -> str:
    """A key or tensor name for a one-line message: quoted, control characters escaped, shortened."""
    quoted = repr(text)
    return quoted if len(quoted) <= 64 else quoted[:60] + "...'"


def _decode(raw: memoryview) -> str:
    # Invalid UTF-8 (raw byte tokens) is kept losslessly: s.encode("utf-8", "surrogateescape") gives the bytes back.
    return str(raw, "utf-8", "surrogateescape")


def _tensor_nbytes(name: str, ggml_dims: tuple[int, ...], type_id: int) -> int:
    try:
        qtype = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise _BadFile(f"tensor {_q(name)} has unknown ggml type id {type_id}") from None
    row = ggml_dims[0] if ggml_dims else 1
    if row % block_size:
        raise _BadFile(
            f"tensor {_q(name)}: row length {row} is not a multiple of the {qtype.name} block size {block_size}"
        )
    return math.prod(ggml_dims) // block_size * type_size


def _check_magic(magic: int) -> None:
    if magic != GGUF_MAGIC:
        found = _U32.pack(magic)
        raise _BadFile(f"not a GGUF file (starts with {found!r}, expected {_U32.pack(GGUF_MAGIC)!r})")


def _check_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version != 0:
            raise _BadFile("big-endian GGUF files are not supported (convert it to little-endian)")
        raise _BadFile(f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")


def _alignment(metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise _BadFile(f"general.alignment must be a positive power of two, got {value!r}")
    return value


def _open_map(path: str) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise _BadFile("file is empty")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise _BadFile("file not found") from None
    except IsADirectoryError:
        raise _BadFile("is a directory, not a GGUF file") from None
    except OSError as e:
        raise _BadFile(f"cannot read file ({e.strerror or e})") from None


class GGUFFile:
    """A parsed GGUF file. Tensor bytes stay in the read-only mapping until `raw()` hands out a view."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        self._data: np.ndarray | None = None
        try:
            self._mm = _open_map(self.path)
            with memoryview(self._mm) as buf:
                self._parse(_Parser(buf))
            self._data = np.frombuffer(self._mm, dtype=np.uint8)
        except _BadFile as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None
        except (struct.error, IndexError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            # Every read above is bounds-checked; this keeps an unforeseen corruption a GGUFError too.
            self.close()
            raise GGUFError(f"{self.path}: corrupt GGUF file ({type(e).__name__}: {e})") from None

    def _parse(self, p: _Parser) -> None:
        if p.size < 4:
            raise _BadFile(f"not a GGUF file (only {p.size} bytes)")
        _check_magic(p.u32("header"))
        version = p.u32("header")
        _check_version(version)
        n_tensors, n_kv = p.u64("header"), p.u64("header")
        self.version = version
        self.metadata = p.metadata(n_kv)
        self.alignment = _alignment(self.metadata)
        infos = [p.tensor_info(i) for i in range(n_tensors)]
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors = {}
        for name, shape, type_id, rel_offset, nbytes in infos:
            self.tensors[name] = self._place(name, shape, type_id, rel_offset, nbytes, p.size)

    def _place(self, name: str, shape: tuple[int, ...], type_id: int, rel: int, nbytes: int, size: int) -> TensorInfo:
        if name in self.tensors:
            raise _BadFile(f"duplicate tensor name {_q(name)}")
        if rel % self.alignment:
            raise _BadFile(f"tensor {_q(name)} offset {rel} is not a multiple of the alignment {self.alignment}")
        offset = self.data_offset + rel
        if offset + nbytes > size:
            raise _BadFile(
                f"file is truncated: tensor {_q(name)} data ends at byte {offset + nbytes}, file has {size} bytes"
            )
        return TensorInfo(name, shape, type_id, offset, nbytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """Read-only uint8 view of exactly the tensor's bytes (no copy)."""
        if self._data is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {_q(name)} not found")
        return self._data[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        """Drop the mapping. Views from `raw()` that are still alive keep it mapped until they go."""
        self._data = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # exported views still reference it; it is unmapped when the last one is collected
            self._mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        n_tensors = len(getattr(self, "tensors", {}))
        return f"GGUFFile({self.path!r}, version={getattr(self, 'version', None)}, tensors={n_tensors})"
