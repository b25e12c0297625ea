"""The fixtures the model tests stand on: tiny GGUF writer, bad files, and the reference forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.support.reference_model import ReferenceModel, apply_rope, attention_mask
from tests.support.tiny_gguf import (
    ARCHITECTURES,
    BAD_KINDS,
    WEIGHT_TYPES,
    bytes_to_unicode,
    write_bad_gguf,
    write_tiny_gguf,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One default F32 file per architecture, written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_gguf(root / f"{arch}.gguf", arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def models(tiny: dict[str, dict[str, Any]]) -> dict[str, ReferenceModel]:
    return {arch: ReferenceModel(info["path"]) for arch, info in tiny.items()}


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def _expected_ggml_shapes(arch: str, info: dict[str, Any]) -> dict[str, list[int]]:
    """Tensor names and ggml (ne) shapes as llama.cpp's converter writes them."""
    h, hd, ff, v = info["hidden_size"], info["head_dim"], info["intermediate_size"], info["vocab_size"]
    q, kv = info["num_heads"] * hd, info["num_kv_heads"] * hd
    shapes = {"token_embd.weight": [h, v], "output_norm.weight": [h]}
    if not info["tie_word_embeddings"]:
        shapes["output.weight"] = [h, v]
    for i in range(info["num_layers"]):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": [h], p + "attn_q.weight": [h, q], p + "attn_k.weight": [h, kv],
            p + "attn_v.weight": [h, kv], p + "attn_output.weight": [q, h], p + "ffn_norm.weight": [h],
            p + "ffn_gate.weight": [h, ff], p + "ffn_up.weight": [h, ff], p + "ffn_down.weight": [ff, h],
        })
        if arch == "qwen2":
            shapes.update({p + "attn_q.bias": [q], p + "attn_k.bias": [kv], p + "attn_v.bias": [kv]})
        if arch in ("qwen3", "gemma3"):
            shapes.update({p + "attn_q_norm.weight": [hd], p + "attn_k_norm.weight": [hd]})
        if arch == "gemma3":
            shapes.update({p + "post_attention_norm.weight": [h], p + "post_ffw_norm.weight": [h]})
    return shapes


# ---------------------------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_file_has_llama_cpp_tensors_and_metadata(arch: str, tiny: dict[str, dict[str, Any]]) -> None:
    info = tiny[arch]
    reader = gguf.GGUFReader(info["path"])
    assert _field(reader, "general.architecture") == arch
    got = {t.name: t.shape.tolist() for t in reader.tensors}
    assert got == _expected_ggml_shapes(arch, info)
    expected_meta = {
        "context_length": 256, "embedding_length": 64, "block_count": info["num_layers"],
        "feed_forward_length": 128, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": info["head_dim"], "attention.value_length": info["head_dim"],
    }
    for key, value in expected_meta.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    assert _field(reader, f"{arch}.rope.freq_base") == pytest.approx(info["rope_theta"])
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(info["rms_norm_eps"])
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == info["vocab_size"]


def test_architecture_specific_defaults(tiny: dict[str, dict[str, Any]]) -> None:
    gemma = tiny["gemma3"]
    assert gemma["num_layers"] == 7 and gemma["head_dim"] == 32
    assert gemma["head_dim"] * gemma["num_heads"] != gemma["hidden_size"]
    assert gemma["sliding_layers"] == [True] * 5 + [False, True]
    reader = gguf.GGUFReader(gemma["path"])
    assert _field(reader, "gemma3.attention.sliding_window") == gemma["sliding_window"] == 8
    assert not tiny["llama"]["tie_word_embeddings"] and tiny["qwen3"]["tie_word_embeddings"]
    assert "gemma3.attention.sliding_window" not in gguf.GGUFReader(tiny["llama"]["path"]).fields


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_weight_types_quantize_matrices_only(tmp_path: Path, weight_type: str) -> None:
    info = write_tiny_gguf(tmp_path / "m.gguf", "gemma3", num_layers=2, weight_type=weight_type)
    reader = gguf.GGUFReader(info["path"])
    for t in reader.tensors:
        expected = weight_type if len(t.shape) == 2 else "F32"
        assert t.tensor_type.name == expected, t.name
        assert info["tensor_types"][t.name] == expected


def test_q8_0_falls_back_to_f16_for_odd_rows(tmp_path: Path) -> None:
    info = write_tiny_gguf(tmp_path / "m.gguf", "llama", weight_type="Q8_0", hidden_size=48,
                           num_heads=3, num_kv_heads=1)
    assert info["tensor_types"]["blk.0.attn_q.weight"] == "F16"  # rows of 48: not whole blocks
    assert info["tensor_types"]["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 128


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf", "qwen2", seed=5)
    write_tiny_gguf(tmp_path / "b.gguf", "qwen2", seed=5)
    write_tiny_gguf(tmp_path / "c.gguf", "qwen2", seed=6)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() != (tmp_path / "c.gguf").read_bytes()


def test_overrides(tmp_path: Path) -> None:
    info = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", num_layers=3, tie_word_embeddings=False,
                           vocab_size=400, chat_template="{{ messages }}")
    reader = gguf.GGUFReader(info["path"])
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names and "blk.2.ffn_up.weight" in names
    assert len(_field(reader, "tokenizer.ggml.tokens")) == info["vocab_size"] == 400
    assert _field(reader, "tokenizer.chat_template") == "{{ messages }}"
    with pytest.raises(ValueError, match="unknown override"):
        write_tiny_gguf(tmp_path / "x.gguf", "llama", hiden_size=32)
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        write_tiny_gguf(tmp_path / "x.gguf", "mamba")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_vocab_layout(arch: str, tiny: dict[str, dict[str, Any]]) -> None:
    reader = gguf.GGUFReader(tiny[arch]["path"])
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert len(_field(reader, "tokenizer.ggml.scores")) == len(tokens)
    byte_ids = [i for i, t in enumerate(types) if t == gguf.TokenType.BYTE]
    assert [tokens[i] for i in byte_ids] == [f"<0x{b:02X}>" for b in range(256)]
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    names = ("<bos>", "<eos>") if arch == "gemma3" else ("<s>", "</s>")
    assert (tokens[bos], tokens[eos]) == names
    assert types[bos] == types[eos] == gguf.TokenType.CONTROL
    assert "\u2581the" in tokens and "\u2581hello" in tokens


def test_byte_level_bpe_vocab_is_consistent(tiny: dict[str, dict[str, Any]]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(tiny["qwen2"]["path"])
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    assert set(tokens[:256]) == set(bytes_to_unicode().values())
    for merge in merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= set(tokens), merge
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    assert tokens[eos] == "<|im_end|>"
    # A stock byte-level BPE built from the metadata must reach the whole-word pieces.
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    enc = tok.encode("hello world, the end")
    assert enc.tokens[:4] == ["hello", "\u0120world", ",", "\u0120the"]
    assert tok.decode(enc.ids) == "hello world, the end"


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_files(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.gguf"
    write_bad_gguf(path, kind)
    assert path.stat().st_size > 0
    if kind == "not_gguf":
        assert path.read_bytes()[:4] != b"GGUF"
        return
    if kind == "truncated":
        assert path.read_bytes()[:4] == b"GGUF"
        with pytest.raises(ValueError):
            gguf.GGUFReader(path)
        return
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    if kind == "unsupported_arch":
        assert _field(reader, "general.architecture") == "mamba"
    elif kind == "unsupported_type":
        assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.IQ2_XXS
        assert tensors["blk.0.ffn_down.weight"].shape.tolist() == [256, 64]
    elif kind == "missing_tensor":
        assert "blk.0.ffn_up.weight" not in tensors and "blk.1.ffn_up.weight" in tensors
    else:  # shape_mismatch
        assert tensors["blk.0.attn_q.weight"].shape.tolist() == [64, 80]
        assert tensors["blk.1.attn_q.weight"].shape.tolist() == [64, 64]


def test_unknown_bad_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown bad-file kind"):
        write_bad_gguf(tmp_path / "x.gguf", "nope")


# ---------------------------------------------------------------------------------------------
# The reference forward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reference_logits_finite_and_not_degenerate(arch: str, tiny: dict[str, dict[str, Any]],
                                                   models: dict[str, ReferenceModel]) -> None:
    ids = _random_ids(32, tiny[arch]["vocab_size"], seed=1)
    logits = models[arch].forward(ids)
    assert logits.shape == (32, tiny[arch]["vocab_size"]) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.2  # greedy choices are clear-cut
    argmax = logits.argmax(-1)
    assert (argmax == torch.tensor(ids)).float().mean() < 0.25  # not just echoing the input
    assert len(set(argmax.tolist())) > 16  # predictions depend on the context


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_causal(arch: str, tiny: dict[str, dict[str, Any]], models: dict[str, ReferenceModel]) -> None:
    vocab = tiny[arch]["vocab_size"]
    ids = _random_ids(20, vocab, seed=2)
    changed = ids[:12] + [(t + 7) % vocab for t in ids[12:]]
    a, b = models[arch].forward(ids), models[arch].forward(changed)
    torch.testing.assert_close(a[:12], b[:12], rtol=0, atol=1e-5)
    assert (a[12:] - b[12:]).abs().amax() > 1e-2
    # A prefix run gives the same logits as the prefix of a longer run.
    torch.testing.assert_close(models[arch].forward(ids[:7]), a[:7], rtol=1e-4, atol=1e-4)


def test_gemma3_sliding_window_receptive_field(tmp_path: Path) -> None:
    """Two local layers with W = 8: token 0 reaches position p only if p <= 2 * (W - 1)."""
    info = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", num_layers=2)
    model = ReferenceModel(info["path"])
    assert model.sliding_layers == [True, True]
    ids = _random_ids(40, info["vocab_size"], seed=3)
    changed = [(ids[0] + 1) % info["vocab_size"]] + ids[1:]
    diff = (model.forward(ids) - model.forward(changed)).abs().amax(-1)
    reach = 2 * (info["sliding_window"] - 1)
    assert (diff[: reach + 1] > 1e-3).all()  # an off-by-one window would miss position `reach`
    assert (diff[reach + 1:] < 1e-5).all()  # ... or leak into position reach + 1


def test_gemma3_global_layer_sees_past_the_window(models: dict[str, ReferenceModel],
                                                  tiny: dict[str, dict[str, Any]]) -> None:
    model, info = models["gemma3"], tiny["gemma3"]
    assert model.sliding_layers == info["sliding_layers"]
    ids = _random_ids(64, info["vocab_size"], seed=4)
    changed = [(ids[0] + 1) % info["vocab_size"]] + ids[1:]
    diff = (model.forward(ids) - model.forward(changed)).abs().amax(-1)
    # 6 local layers alone reach 6 * 7 = 42 positions; layer 5 attends to everything.
    assert (diff[50:] > 1e-3).all()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0"])
def test_dequantized_files_track_f32(tmp_path: Path, arch: str, weight_type: str,
                                     models: dict[str, ReferenceModel],
                                     tiny: dict[str, dict[str, Any]]) -> None:
    info = write_tiny_gguf(tmp_path / "m.gguf", arch, weight_type=weight_type)
    ids = _random_ids(24, info["vocab_size"], seed=5)
    ref = models[arch].forward(ids)
    got = ReferenceModel(info["path"]).forward(ids)
    tol = {"F16": 0.1, "BF16": 0.5, "Q8_0": 1.5}[weight_type]
    assert (got - ref).abs().amax() < tol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    assert not torch.equal(got, ref)  # the file really holds rounded weights


def test_token_ids_are_checked(models: dict[str, ReferenceModel]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        models["llama"].forward([0, 10_000])
    with pytest.raises(ValueError, match="token ids"):
        models["llama"].forward([])


# ---------------------------------------------------------------------------------------------
# Building blocks of the reference
# ---------------------------------------------------------------------------------------------

def test_normal_rope_on_llama_cpp_permuted_rows_equals_neox() -> None:
    """llama.cpp's converter permutes each Llama head's q/k rows (HF halves -> adjacent pairs),
    so NORM-style RoPE on the GGUF layout must equal NEOX-style RoPE on HF's layout."""
    t, heads, hd = 9, 3, 16
    x_hf = torch.randn(t, heads, hd, generator=torch.Generator().manual_seed(0))

    def to_gguf(x: torch.Tensor) -> torch.Tensor:
        return x.view(t, heads, 2, hd // 2).transpose(-1, -2).reshape(t, heads, hd)

    pos = torch.arange(t) * 5
    neox = apply_rope(x_hf, pos, 10000.0, neox=True)
    normal = apply_rope(to_gguf(x_hf), pos, 10000.0, neox=False)
    torch.testing.assert_close(normal, to_gguf(neox))


@pytest.mark.parametrize("neox", [True, False])
def test_rope_scores_depend_on_relative_position_only(neox: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def score(pq: int, pk: int) -> float:
        rq = apply_rope(q, torch.tensor([pq]), 1e6, neox)
        rk = apply_rope(k, torch.tensor([pk]), 1e6, neox)
        return float((rq * rk).sum())

    assert score(3, 1) == pytest.approx(score(103, 101), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
    torch.testing.assert_close(apply_rope(q, torch.tensor([0]), 1e4, neox), q)


def test_partial_rotary_leaves_tail_alone() -> None:
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2))
    y = apply_rope(x, torch.arange(4), 1e4, neox=True, n_rot=8)
    torch.testing.assert_close(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[1:, :, :8], x[1:, :, :8])


def test_attention_mask_window_rule() -> None:
    visible = attention_mask(6, 3) == 0
    # llama.cpp LLAMA_SWA_TYPE_STANDARD: key p0 hidden from query p1 when p1 - p0 >= n_swa.
    expected = np.array([[0 <= q - k < 3 for k in range(6)] for q in range(6)])
    assert (visible.numpy() == expected).all()
    assert (attention_mask(5, 0) == 0).numpy().tolist() == np.tril(np.ones((5, 5), bool)).tolist()
