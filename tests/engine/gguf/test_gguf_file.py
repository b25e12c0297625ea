"""GGUFFile: round-trip against gguf.GGUFWriter / GGUFReader, and every malformed-file case."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from app.engine.gguf.reader import GGUFFile, TensorInfo
from app.engine.types.errors import GGUFError, LocalbatchError

# ---------------------------------------------------------------- files written by gguf.GGUFWriter

SCALARS = [
    ("t.u8", VT.UINT8, 200),
    ("t.i8", VT.INT8, -100),
    ("t.u16", VT.UINT16, 60000),
    ("t.i16", VT.INT16, -30000),
    ("t.u32", VT.UINT32, 4_000_000_000),
    ("t.i32", VT.INT32, -2_000_000_000),
    ("t.f32", VT.FLOAT32, 0.1),
    ("t.bool", VT.BOOL, True),
    ("t.str", VT.STRING, "héllo ▁wörld"),
    ("t.u64", VT.UINT64, 2**64 - 1),
    ("t.i64", VT.INT64, -(2**63)),
    ("t.f64", VT.FLOAT64, 1e300),
]
NUMERIC_ARRAYS = [
    (VT.UINT8, np.uint8), (VT.INT8, np.int8), (VT.UINT16, np.uint16), (VT.INT16, np.int16),
    (VT.UINT32, np.uint32), (VT.INT32, np.int32), (VT.FLOAT32, np.float32), (VT.UINT64, np.uint64),
    (VT.INT64, np.int64), (VT.FLOAT64, np.float64),
]
TOKENS = ["<pad>", "<eos>", "", "▁the", "日本", "\n", "a" * 300]


def _tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, QT]]:
    """name -> (array as GGUFWriter takes it, type): float tensors as values, quantized ones as bytes."""
    return {
        "a.f32": (rng.standard_normal((3, 5, 7)).astype(np.float32), QT.F32),
        "b.f16": (rng.standard_normal((4, 64)).astype(np.float16), QT.F16),
        "c.q8_0": (gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), QT.Q8_0), QT.Q8_0),
        "d.q4_k": (rng.integers(0, 256, (2, 144), dtype=np.uint8), QT.Q4_K),
        "e.bf16": (rng.integers(0, 2**15, (8,), dtype=np.uint16).view(np.uint8), QT.BF16),
        "f.scalar": (np.array([2.5], dtype=np.float32), QT.F32),
    }


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QT]], alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch="testarch")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, value in SCALARS:
        w.add_key_value(key, value, vtype)
    for vtype, np_type in NUMERIC_ARRAYS:
        w.add_key_value(f"t.arr.{vtype.name.lower()}", [np_type(v).item() for v in (0, 1, 2, 100)], VT.ARRAY, vtype)
    w.add_key_value("t.arr.bool", [True, False, True], VT.ARRAY, VT.BOOL)
    w.add_array("t.arr.str", TOKENS)
    w.add_key_value("t.arr.nested", [[1, 2, 3], [4], ["x", "y"]], VT.ARRAY, VT.ARRAY)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[np.ndarray, QT]]]:
    tensors = _tensors(np.random.default_rng(0))
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    _write(path, tensors)
    return path, tensors


def test_metadata_round_trip(written) -> None:
    path, _ = written
    with GGUFFile(path) as f:
        md = f.metadata
        assert f.version == 3 and f.path == str(path)
        assert md["general.architecture"] == "testarch"
        for key, vtype, value in SCALARS:
            expected = float(np.float32(value)) if vtype == VT.FLOAT32 else value
            assert md[key] == expected and type(md[key]) is type(value), key
        for vtype, np_type in NUMERIC_ARRAYS:
            arr = md[f"t.arr.{vtype.name.lower()}"]
            assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(np_type) and arr.tolist() == [0, 1, 2, 100]
        assert md["t.arr.bool"].dtype == np.bool_ and md["t.arr.bool"].tolist() == [True, False, True]
        assert md["t.arr.str"] == TOKENS
        nested = md["t.arr.nested"]
        assert isinstance(nested, list) and [x.tolist() for x in nested[:2]] == [[1, 2, 3], [4]]
        assert nested[2] == ["x", "y"]
        assert f.get("t.u8") == 200 and f.get("missing") is None and f.get("missing", 7) == 7
        assert f.alignment == 32


def test_metadata_matches_gguf_reader(written) -> None:
    path, _ = written
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        assert list(f.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or field.types[:2] == [VT.ARRAY, VT.ARRAY]:
                continue  # GGUFReader flattens nested arrays; test_metadata_round_trip checks them
            expected = field.contents()
            got = f.metadata[key]
            assert (got.tolist() if isinstance(got, np.ndarray) else got) == expected, key


def test_tensors_round_trip(written) -> None:
    path, tensors = written
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        assert list(f.tensors) == list(tensors)
        assert f.data_offset % f.alignment == 0
        for rt in reader.tensors:
            info = f.tensors[rt.name]
            arr, qtype = tensors[rt.name]
            assert isinstance(info, TensorInfo)
            assert info.ggml_type == qtype and info.type_name == qtype.name
            assert info.shape == tuple(int(d) for d in reversed(rt.shape))
            assert info.offset == rt.data_offset and info.nbytes == rt.n_bytes
            raw = f.raw(rt.name)
            assert raw.dtype == np.uint8 and raw.shape == (info.nbytes,)
            assert np.array_equal(raw, np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
            assert not raw.flags.writeable and not raw.flags.owndata
        assert f.tensors["a.f32"].shape == (3, 5, 7)
        assert f.tensors["c.q8_0"].shape == (6, 64) and f.tensors["c.q8_0"].n_elements == 384
        assert f.tensors["d.q4_k"].shape == (2, 256)


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    _write(path, _tensors(np.random.default_rng(1)), alignment=64)
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert all(t.offset % 64 == 0 for t in f.tensors.values())


def test_close_and_views(written) -> None:
    path, tensors = written
    f = GGUFFile(path)
    view = f.raw("a.f32")
    f.close()
    f.close()  # idempotent
    # A view taken before close() keeps the mapping alive.
    assert np.array_equal(view, tensors["a.f32"][0].view(np.uint8).reshape(-1))
    with pytest.raises(ValueError, match="closed"):
        f.raw("a.f32")
    with GGUFFile(path) as g:
        with pytest.raises(GGUFError, match="tensor 'nope' not found"):
            g.raw("nope")
        assert "tensors=6" in repr(g)


# ---------------------------------------------------------------- crafted files


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, VT.UINT32, struct.pack("<I", value))


def _ti(name: str, ggml_dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _s(name) + struct.pack(f"<I{len(ggml_dims)}QIQ", len(ggml_dims), *ggml_dims, type_id, offset)


def _gguf(kvs: list[bytes], tis: list[bytes] = (), data: bytes = b"", version: int = 3, alignment: int = 32) -> bytes:
    body = b"GGUF" + struct.pack("<IQQ", version, len(tis), len(kvs)) + b"".join(kvs) + b"".join(tis)
    return body + b"\0" * (-len(body) % alignment) + data


def _f32_tensor(name: str = "w", n: int = 8) -> tuple[bytes, bytes]:
    return _ti(name, (n,), QT.F32, 0), np.arange(n, dtype=np.float32).tobytes()


def _error(path: Path) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert isinstance(info.value, LocalbatchError)
    return message


def _bad(tmp_path: Path, content: bytes, name: str = "bad.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return _error(path)


def test_crafted_minimal_file(tmp_path: Path) -> None:
    ti, data = _f32_tensor()
    kvs = [
        _kv("empty.str_arr", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0)),
        _kv("empty.f32_arr", VT.ARRAY, struct.pack("<IQ", VT.FLOAT32, 0)),
        _kv("bad.utf8", VT.STRING, _s(b"\xff<0x80>")),
    ]
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf(kvs, [ti], data, version=2))
    with GGUFFile(path) as f:
        assert f.version == 2
        assert f.metadata["empty.str_arr"] == [] and f.metadata["empty.f32_arr"].shape == (0,)
        # Invalid UTF-8 survives losslessly.
        assert f.metadata["bad.utf8"].encode("utf-8", "surrogateescape") == b"\xff<0x80>"
        assert np.array_equal(f.raw("w").view(np.float32), np.arange(8, dtype=np.float32))


def test_missing_empty_and_directory(tmp_path: Path) -> None:
    assert "file not found" in _error(tmp_path / "nope.gguf")
    assert "is a directory" in _error(tmp_path)
    assert "file is empty" in _bad(tmp_path, b"")


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"PK\x03\x04" + b"\0" * 40, r"not a GGUF file (starts with b'PK\x03\x04', expected b'GGUF')"),
        (b"GG", "not a GGUF file (only 2 bytes)"),
        (b"GGML" + struct.pack("<I", 3), "not a GGUF file (starts with b'GGML'"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "unsupported GGUF version 1 (supported: 2, 3)"),
        (b"GGUF" + struct.pack("<IQQ", 4, 0, 0), "unsupported GGUF version 4"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian GGUF files are not supported"),
        (b"GGUF\x03\x00", "file is truncated"),
    ],
)
def test_bad_header(tmp_path: Path, content: bytes, expected: str) -> None:
    assert expected in _bad(tmp_path, content)


def test_flipped_magic(tmp_path: Path, written) -> None:
    data = bytearray(Path(written[0]).read_bytes())
    data[0] ^= 0xFF
    assert "not a GGUF file (starts with b'\\xb8GUF'" in _bad(tmp_path, bytes(data))


@pytest.mark.parametrize(
    "kvs, tis, expected",
    [
        ([_kv("k", 13, b"\0" * 8)], [], "metadata 'k' has unknown value type 13"),
        ([_kv("k", VT.ARRAY, struct.pack("<IQ", 77, 1))], [], "metadata 'k' is an array of unknown value type 77"),
        ([_u32("k", 1), _u32("k", 2)], [], "duplicate metadata key 'k'"),
        ([_u32("general.alignment", 24)], [], "general.alignment must be a positive power of two, got 24"),
        ([_kv("general.alignment", VT.STRING, _s("32"))], [], "general.alignment must be a positive power of two"),
        ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**60))], [], "metadata 'k' (1152921504606846976 items)"),
        ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2**40))], [], "file is truncated: metadata 'k'"),
        ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.INT64, 2**40))], [], "file is truncated: metadata 'k'"),
        ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 9)], [], "metadata 'k' nests arrays more than 8 deep"),
        ([], [_ti("w", (8,), 99, 0)], "tensor 'w' has unknown ggml type id 99"),
        ([], [_ti("w", (8,), 4, 0)], "tensor 'w' has unknown ggml type id 4"),  # Q4_2: removed from ggml
        ([], [_ti("w", (1, 1, 1, 1, 1), QT.F32, 0)], "tensor 'w' has 5 dimensions (at most 4 supported)"),
        ([], [_ti("w", (48, 2), QT.Q8_0, 0)], "tensor 'w': row length 48 is not a multiple of the Q8_0 block size 32"),
        ([], [_ti("w", (8,), QT.F32, 0), _ti("w", (8,), QT.F32, 32)], "duplicate tensor name 'w'"),
        ([], [_ti("w", (8,), QT.F32, 4)], "tensor 'w' offset 4 is not a multiple of the alignment 32"),
        ([], [_ti("w", (1 << 20,), QT.F32, 0)], "file is truncated: tensor 'w' data ends at byte"),
        ([], [_ti("w", (8,), QT.F32, 1 << 40)], "file is truncated: tensor 'w' data ends at byte"),
    ],
)
def test_bad_metadata_and_tensor_infos(tmp_path: Path, kvs: list[bytes], tis: list[bytes], expected: str) -> None:
    assert expected in _bad(tmp_path, _gguf(kvs, tis, data=b"\0" * 64))


def test_bad_utf8_key(tmp_path: Path) -> None:
    # Like string values, an invalid UTF-8 key is kept (surrogate-escaped) rather than rejected.
    path = tmp_path / "key.gguf"
    path.write_bytes(_gguf([_s(b"\xffk") + struct.pack("<II", VT.UINT32, 5)]))
    with GGUFFile(path) as f:
        assert f.metadata == {b"\xffk".decode("utf-8", "surrogateescape"): 5}


def test_patched_type_id(tmp_path: Path, written) -> None:
    data = bytearray(Path(written[0]).read_bytes())
    at = data.index(b"c.q8_0") + len(b"c.q8_0")
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    assert "tensor 'c.q8_0' has unknown ggml type id 99" in _bad(tmp_path, bytes(data))


def test_truncated_tensor_data_names_the_tensor(tmp_path: Path, written) -> None:
    data = Path(written[0]).read_bytes()
    with GGUFFile(written[0]) as f:
        last = list(f.tensors.values())[-1]
    message = _bad(tmp_path, data[: last.offset + 2])
    assert f"file is truncated: tensor '{last.name}' data ends at byte {last.offset + last.nbytes}" in message


def test_every_truncation_point_is_a_gguf_error(tmp_path: Path, written) -> None:
    data = Path(written[0]).read_bytes()
    with GGUFFile(written[0]) as f:
        end = max(t.offset + t.nbytes for t in f.tensors.values())
        edges = {t.offset + d for t in f.tensors.values() for d in (-1, 0, 1, t.nbytes - 1)}
    path = tmp_path / "cut.gguf"
    # Every byte of the fixed header, then a stride through metadata, tensor infos and data.
    for cut in sorted({*range(32), *range(32, end, 5), *edges}):
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as info:
            GGUFFile(path)
        assert "\n" not in str(info.value)
        assert cut < 4 or "truncated" in str(info.value), (cut, str(info.value))
    path.write_bytes(data[:end])
    GGUFFile(path).close()  # trailing padding is optional


def test_random_corruption_never_escapes_as_another_exception(tmp_path: Path, written) -> None:
    data = Path(written[0]).read_bytes()
    with GGUFFile(written[0]) as f:
        header_end = f.data_offset
    rng = random.Random(1234)
    path = tmp_path / "fuzz.gguf"
    for _ in range(400):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(header_end)] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        try:
            GGUFFile(path).close()
        except GGUFError as e:
            assert "\n" not in str(e) and len(str(e)) < 300


# ---------------------------------------------------------------- the embedded model


@pytest.mark.slow
def test_embedded_model(embedded_model_path: Path) -> None:
    start = time.perf_counter()
    f = GGUFFile(embedded_model_path)
    elapsed = time.perf_counter() - start
    with f:
        assert f.get("general.architecture") == "gemma3"
        assert f.get("gemma3.block_count") == 18
        assert f.get("gemma3.embedding_length") == 640
        tokens = f.get("tokenizer.ggml.tokens")
        assert isinstance(tokens, list) and len(tokens) == 262144 and tokens[:3] == ["<pad>", "<eos>", "<bos>"]
        scores = f.get("tokenizer.ggml.scores")
        assert scores.dtype == np.float32 and scores.shape == (262144,)
        assert f.get("tokenizer.ggml.token_type").dtype == np.int32
        assert len(f.tensors) == 236
        embd = f.tensors["token_embd.weight"]
        assert embd.type_name == "Q8_0" and embd.shape == (262144, 640)
        assert embd.nbytes == 262144 * 640 // 32 * 34
        assert f.tensors["blk.0.ffn_up.weight"].shape == (2048, 640)
        types = {t.type_name for t in f.tensors.values()}
        assert types == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    # Generous bound for a loaded 2-core CI machine; ~0.1 s when idle (GGUFReader: ~10 s).
    assert elapsed < 5, f"parsing took {elapsed:.2f} s"
