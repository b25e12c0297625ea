"""A GGUF with a real model's metadata, tokenizer and chat template but random weights: for
benchmarks where the real file cannot go (the GPU machine takes 64 MiB of files a call) and for
a model small enough that serving costs show against the engine as they do on a GPU.

    python tools/shape_alike_gguf.py skeleton SRC.gguf SKEL.gguf   # metadata + norms, ~2 MB
    python tools/shape_alike_gguf.py fill SKEL.gguf OUT.gguf        # SRC's shapes, random F16
    python tools/shape_alike_gguf.py fill SKEL.gguf OUT.gguf --tiny # 2 layers, 64 wide (llama)

Throughput only: the text such a model writes is noise."""

from __future__ import annotations

import argparse
import json

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor

SHAPES_KEY = "shape_alike.tensors"  # the skeleton's list of (name, numpy shape) left to fill
TINY = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
        "attention.head_count_kv": 2, "rope.dimension_count": 16}


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, override: dict[str, object]) -> None:
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", SHAPES_KEY):
            continue
        kind = f.types[0]
        sub = f.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, override.get(f.name, f.contents()), kind, sub_type=sub)


def _shape(tensor: ReaderTensor) -> list[int]:
    """numpy's order (gguf lists a tensor's dimensions innermost first)."""
    return [int(x) for x in reversed(tensor.shape.tolist())]


def skeleton(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer, {})
    rest = []
    for t in reader.tensors:
        if t.tensor_type.name == "F32":  # norms and biases: small, and kept real
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(_shape(t)))
        else:
            rest.append([t.name, _shape(t)])
    writer.add_key_value(SHAPES_KEY, json.dumps(rest), GGUFValueType.STRING)
    _write(writer)


def fill(skel: str, dst: str, tiny: bool) -> None:
    reader = GGUFReader(skel)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    rng = np.random.default_rng(0)
    if not tiny:
        copy_metadata(reader, writer, {})
        for t in reader.tensors:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(_shape(t)))
        for name, shape in json.loads(reader.fields[SHAPES_KEY].contents()):
            writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float16))
        _write(writer)
        return
    if arch != "llama":
        raise SystemExit(f"--tiny builds a llama; {skel} is a {arch}")
    copy_metadata(reader, writer, {f"llama.{k}": v for k, v in TINY.items()})
    _tiny_tensors(writer, rng, len(reader.fields["tokenizer.ggml.tokens"].contents()))
    _write(writer)


def _tiny_tensors(writer: GGUFWriter, rng: np.random.Generator, vocab: int) -> None:
    d, ff = TINY["embedding_length"], TINY["feed_forward_length"]
    heads, kv = TINY["attention.head_count"], TINY["attention.head_count_kv"]
    hd = d // heads

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.1

    writer.add_tensor("token_embd.weight", rand(vocab, d))
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(TINY["block_count"]):
        for name, tensor in (("attn_norm", np.ones(d, np.float32)), ("ffn_norm", np.ones(d, np.float32)),
                             ("attn_q", rand(heads * hd, d)), ("attn_k", rand(kv * hd, d)),
                             ("attn_v", rand(kv * hd, d)), ("attn_output", rand(d, heads * hd)),
                             ("ffn_gate", rand(ff, d)), ("ffn_up", rand(ff, d)), ("ffn_down", rand(d, ff))):
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor)


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("skeleton")
    s.add_argument("src")
    s.add_argument("dst")
    f = sub.add_parser("fill")
    f.add_argument("skel")
    f.add_argument("dst")
    f.add_argument("--tiny", action="store_true", help="2 layers, 64 wide, the skeleton's vocabulary (llama only)")
    args = p.parse_args()
    if args.cmd == "skeleton":
        skeleton(args.src, args.dst)
    else:
        fill(args.skel, args.dst, args.tiny)


if __name__ == "__main__":
    main()
