"""Tiny random-weight GGUF files in llama.cpp's layout, for model and loader tests.

`write_tiny_gguf` writes a few-hundred-KB model per supported architecture with the metadata keys,
tensor names and tensor shapes that llama.cpp's `convert_hf_to_gguf.py` produces, plus a tokenizer
in llama.cpp's GGUF layout. `write_bad_gguf` writes files the loader must reject with a clear error.

GGUFWriter takes numpy arrays in [out_features, in_features] order and stores them with ggml's
reversed dimension order, exactly as the converter does.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0")
BAD_KINDS = (
    "unsupported_arch",
    "unsupported_type",
    "missing_tensor",
    "shape_mismatch",
    "truncated",
    "not_gguf",
)

# llama.cpp hardcodes Gemma 3's layer pattern (set_swa_pattern(6)); the GGUF does not store it.
GEMMA3_SWA_PATTERN = 6

# Per-architecture defaults. Gemma 3's head_dim differs from hidden/heads like the real models;
# its 7 layers give one global layer (index 5). Tied embeddings: Qwen3-0.6B and Gemma 3 tie,
# Llama 2 and Qwen2.5-7B do not, so both loader paths get covered.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(num_layers=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, tokenizer_model="llama", sliding_window=None),
    "qwen2": dict(num_layers=2, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, tokenizer_model="gpt2", sliding_window=None),
    "qwen3": dict(num_layers=2, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, tokenizer_model="gpt2", sliding_window=None),
    "gemma3": dict(num_layers=7, head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, tokenizer_model="llama", sliding_window=8),
}


@dataclass(frozen=True)
class TinyConfig:
    """Hyperparameters of one tiny model (HF/vLLM names; GGUF keys are written from them)."""

    arch: str
    num_layers: int
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    tokenizer_model: str = "llama"
    vocab_size: int | None = None  # None: exactly the generated tokenizer's size
    chat_template: str | None = None
    weight_type: str = "F32"


_OVERRIDABLE = frozenset(TinyConfig.__dataclass_fields__) - {"arch", "num_layers", "weight_type"}


def make_config(arch: str, *, num_layers: int | None = None, weight_type: str = "F32",
                **overrides: Any) -> TinyConfig:
    """Defaults for `arch` with `overrides` applied; raises ValueError on unknown names."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r}; choose one of {WEIGHT_TYPES}")
    unknown = sorted(set(overrides) - _OVERRIDABLE)
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(_OVERRIDABLE)}")
    fields = {**_ARCH_DEFAULTS[arch], **overrides}
    if num_layers is not None:
        fields["num_layers"] = num_layers
    if fields["tokenizer_model"] not in ("llama", "gpt2"):
        raise ValueError("tokenizer_model must be 'llama' (SentencePiece) or 'gpt2' (byte-level BPE)")
    return TinyConfig(arch=arch, weight_type=weight_type, **fields)


def sliding_layers(cfg: TinyConfig) -> list[bool]:
    """Which layers use the sliding window (llama.cpp: il % 6 < 5 for Gemma 3)."""
    if cfg.arch != "gemma3" or not cfg.sliding_window:
        return [False] * cfg.num_layers
    return [(i + 1) % GEMMA3_SWA_PATTERN != 0 for i in range(cfg.num_layers)]


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------

# Words whose pieces go into both tokenizers so that ordinary English text mostly avoids byte
# fallback; prefixes of each word are added so that BPE/SPM merging can actually reach them.
_WORDS = ("the", "and", "hello", "world", "of", "to", "in", "is", "that", "it", "for", "on",
          "with", "as", "was", "be", "at", "this", "you", "are")
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;"


@dataclass(frozen=True)
class TinyVocab:
    """Token list and special ids in llama.cpp's `tokenizer.ggml.*` layout."""

    model: str
    pre: str | None
    tokens: list[str]
    scores: list[float] | None
    token_types: list[int]
    merges: list[str] | None
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_space_prefix: bool | None
    special_tokens: dict[str, int]


def _word_prefixes(words: tuple[str, ...], lead: str) -> list[str]:
    """`lead+w[:k]` for k >= 1, deduplicated, shortest first (a valid merge order)."""
    seen: dict[str, None] = {}
    for k in range(1, max(len(w) for w in words) + 1):
        for w in words:
            if k <= len(w):
                seen.setdefault(lead + w[:k], None)
    return list(seen)


def _spm_vocab(arch: str) -> TinyVocab:
    """SentencePiece vocab (`tokenizer.ggml.model = "llama"`): controls, 256 byte tokens, pieces."""
    if arch == "gemma3":
        # Gemma's order: <pad>, <eos>, <bos>, <unk>, then its turn markers (ids differ from the
        # real 105/106, the metadata ids are what counts).
        controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        types = [TokenType.CONTROL] * len(controls)
        bos, eos, unk, pad = 2, 1, 3, 0
    else:
        controls = ["<unk>", "<s>", "</s>"]
        types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
        bos, eos, unk, pad = 1, 2, 0, None
    tokens = list(controls)
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    scores += [0.0] * 256
    pieces = ["\u2581"] + list(_CHARS) + _word_prefixes(_WORDS, "\u2581")
    # SentencePiece scores are log-probabilities: later (rarer, longer) pieces score lower.
    for rank, piece in enumerate(dict.fromkeys(pieces)):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))
    special = {t: i for i, t in enumerate(controls)}
    return TinyVocab(
        model="llama", pre="default", tokens=tokens, scores=scores,
        token_types=[int(t) for t in types], merges=None, bos_token_id=bos, eos_token_id=eos,
        unk_token_id=unk, pad_token_id=pad, add_bos_token=True,
        add_space_prefix=(arch != "gemma3"), special_tokens=special,
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 maps to itself)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bpe_vocab() -> TinyVocab:
    """Byte-level BPE vocab (`tokenizer.ggml.model = "gpt2"`, pre "qwen2") with merges."""
    byte_chars = bytes_to_unicode()
    # Qwen's vocab starts with the 256 byte characters in table order.
    tokens = [byte_chars[b] for b in sorted(byte_chars, key=lambda b: ord(byte_chars[b]))]
    space = byte_chars[ord(" ")]  # "Ġ"
    merges: list[str] = []
    # Space-led chains first: a lower rank wins in BPE, so " the" reaches "Ġthe" instead of
    # stopping at "Ġ" + "the".
    for lead in (space, ""):
        for word in _WORDS:
            symbols = [lead, *word] if lead else list(word)
            piece = symbols[0]
            for sym in symbols[1:]:
                merge, piece = f"{piece} {sym}", piece + sym
                if merge not in merges:
                    merges.append(merge)
                if piece not in tokens:
                    tokens.append(piece)
    types = [int(TokenType.NORMAL)] * len(tokens)
    special = {}
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        special[name] = len(tokens)
        tokens.append(name)
        types.append(int(TokenType.CONTROL))
    # Qwen's GGUFs: bos = pad = <|endoftext|> but BOS is not added; instruct eos = <|im_end|>.
    return TinyVocab(
        model="gpt2", pre="qwen2", tokens=tokens, scores=None, token_types=types, merges=merges,
        bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
        unk_token_id=None, pad_token_id=special["<|endoftext|>"], add_bos_token=False,
        add_space_prefix=None, special_tokens=special,
    )


def build_vocab(cfg: TinyConfig) -> TinyVocab:
    """The tokenizer for `cfg`, padded with unused tokens up to `cfg.vocab_size` if given."""
    vocab = _spm_vocab(cfg.arch) if cfg.tokenizer_model == "llama" else _bpe_vocab()
    if cfg.vocab_size is None:
        return vocab
    n_pad = cfg.vocab_size - len(vocab.tokens)
    if n_pad < 0:
        raise ValueError(f"vocab_size must be at least {len(vocab.tokens)} for this tokenizer")
    return replace(
        vocab,
        tokens=vocab.tokens + [f"<unused{i}>" for i in range(n_pad)],
        token_types=vocab.token_types + [int(TokenType.UNUSED)] * n_pad,
        scores=None if vocab.scores is None else vocab.scores + [-1e9] * n_pad,
    )


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

# Gains chosen so that logits have a std of a few nats over the ~330-token vocab (clear top-1
# margins) and attention scores have O(1) spread (attention is not uniform, so masks matter).
_EMBED_STD = 0.5
_BIAS_STD = 0.3
_NORM_JITTER = 0.1
# With tied embeddings the input token's own embedding survives in the residual stream and its
# logit dominates (the model would just repeat the last token). Larger residual branches (output
# projections, or Gemma's post-norm multipliers, which set the branch scale) drown it out.
_BRANCH_GAIN = {"llama": 1.0, "qwen2": 1.0, "qwen3": 3.0, "gemma3": 8.0}


def _linear(rng: np.random.Generator, out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((out_f, in_f)) * (gain / np.sqrt(in_f))).astype(np.float32)


def _norm(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    # Stored values are the multiplier itself: for Gemma this already includes the "+1" that
    # llama.cpp's converter folds into the file, so readers must not add it again.
    return (scale * (1.0 + _NORM_JITTER * rng.standard_normal(n))).astype(np.float32)


def build_tensors(cfg: TinyConfig, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """float32 tensors by GGUF name, in [out, in] order, in the converter's per-layer order."""
    rng = np.random.default_rng(seed)
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
    post_norm_scale = _BRANCH_GAIN[cfg.arch] if cfg.arch == "gemma3" else 1.0
    proj_gain = 1.0 if cfg.arch == "gemma3" else _BRANCH_GAIN[cfg.arch]
    t: dict[str, np.ndarray] = {
        "token_embd.weight": (rng.standard_normal((vocab_size, h)) * _EMBED_STD).astype(np.float32)
    }
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _norm(rng, h)
        t[p + "attn_q.weight"] = _linear(rng, q_dim, h)
        t[p + "attn_k.weight"] = _linear(rng, kv_dim, h)
        t[p + "attn_v.weight"] = _linear(rng, kv_dim, h)
        if cfg.arch == "qwen2":
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                t[p + name + ".bias"] = (rng.standard_normal(n) * _BIAS_STD).astype(np.float32)
        if cfg.arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"] = _norm(rng, hd)
            t[p + "attn_k_norm.weight"] = _norm(rng, hd)
        t[p + "attn_output.weight"] = _linear(rng, h, q_dim, proj_gain)
        if cfg.arch == "gemma3":
            t[p + "post_attention_norm.weight"] = _norm(rng, h, post_norm_scale)
        t[p + "ffn_norm.weight"] = _norm(rng, h)
        t[p + "ffn_gate.weight"] = _linear(rng, ff, h)
        t[p + "ffn_up.weight"] = _linear(rng, ff, h)
        t[p + "ffn_down.weight"] = _linear(rng, h, ff, proj_gain)
        if cfg.arch == "gemma3":
            t[p + "post_ffw_norm.weight"] = _norm(rng, h, post_norm_scale)
    t["output_norm.weight"] = _norm(rng, h)
    if not cfg.tie_word_embeddings:
        t["output.weight"] = _linear(rng, vocab_size, h, gain=_EMBED_STD * np.sqrt(h))
    return t


_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def encode_tensor(arr: np.ndarray, weight_type: str) -> tuple[np.ndarray, QType | None]:
    """(data, raw_dtype) for GGUFWriter.add_tensor, following the converter's rules:
    1-D tensors (norms, biases) stay F32; Q8_0 falls back to F16 when a row is not whole blocks."""
    if arr.ndim < 2 or weight_type == "F32":
        return arr.astype(np.float32), None
    if weight_type == "F16":
        return arr.astype(np.float16), None
    qtype = QType.BF16 if weight_type == "BF16" else QType.Q8_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block != 0:
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, qtype), qtype


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

def _add_hparams(w: gguf.GGUFWriter, cfg: TinyConfig) -> None:
    w.add_name(f"tiny-{cfg.arch}")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)  # the Llama converter writes n_rot
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(_FILE_TYPES[cfg.weight_type])
    if cfg.weight_type == "Q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(w: gguf.GGUFWriter, vocab: TinyVocab, chat_template: str | None) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.token_types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_token_id)
    w.add_eos_token_id(vocab.eos_token_id)
    if vocab.unk_token_id is not None:
        w.add_unk_token_id(vocab.unk_token_id)
    if vocab.pad_token_id is not None:
        w.add_pad_token_id(vocab.pad_token_id)
    w.add_add_bos_token(vocab.add_bos_token)
    w.add_add_eos_token(False)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _write_file(path: str | os.PathLike[str], arch: str, cfg: TinyConfig | None,
                vocab: TinyVocab, tensors: dict[str, tuple[np.ndarray, QType | None]],
                chat_template: str | None = None) -> None:
    w = gguf.GGUFWriter(os.fspath(path), arch)
    if cfg is not None:
        _add_hparams(w, cfg)
    _add_vocab(w, vocab, chat_template)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _encode_all(tensors: dict[str, np.ndarray], weight_type: str
                ) -> dict[str, tuple[np.ndarray, QType | None]]:
    return {name: encode_tensor(arr, weight_type) for name, arr in tensors.items()}


def _describe(path: str | os.PathLike[str], cfg: TinyConfig, vocab: TinyVocab,
              encoded: dict[str, tuple[np.ndarray, QType | None]],
              tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    def type_name(data: np.ndarray, raw: QType | None) -> str:
        return raw.name if raw is not None else ("F16" if data.dtype == np.float16 else "F32")

    return {
        **asdict(cfg),
        "path": os.fspath(path),
        "vocab_size": len(vocab.tokens),
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "special_tokens": dict(vocab.special_tokens),
        "tokens": list(vocab.tokens),
        "sliding_layers": sliding_layers(cfg),
        "tensor_shapes": {n: tuple(a.shape) for n, a in tensors.items()},
        "tensor_types": {n: type_name(d, r) for n, (d, r) in encoded.items()},
    }


def write_tiny_gguf(path: str | os.PathLike[str], arch: str, *, seed: int = 0,
                    num_layers: int | None = None, weight_type: str = "F32",
                    **overrides: Any) -> dict[str, Any]:
    """Write a tiny random-weight GGUF for `arch` and describe it.

    overrides: any TinyConfig field except arch (hidden_size, num_heads, num_kv_heads, head_dim,
    intermediate_size, context_length, rope_theta, rms_norm_eps, sliding_window,
    tie_word_embeddings, tokenizer_model, vocab_size, chat_template).
    Returns the config fields plus path, vocab_size, bos/eos ids, special_tokens, tokens,
    sliding_layers and per-tensor numpy shapes ([out, in]) and GGML type names.
    """
    cfg = make_config(arch, num_layers=num_layers, weight_type=weight_type, **overrides)
    vocab = build_vocab(cfg)
    tensors = build_tensors(cfg, len(vocab.tokens), seed)
    encoded = _encode_all(tensors, weight_type)
    _write_file(path, arch, cfg, vocab, encoded, cfg.chat_template)
    return _describe(path, cfg, vocab, encoded, tensors)


# ----------------------------------------------------------------------------------------------
# Bad files for loader tests
# ----------------------------------------------------------------------------------------------

def _iq2_xxs_bytes(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """IQ2_XXS blocks (256 values, 66 bytes) with a finite fp16 scale, so only the type is 'bad'."""
    block, type_size = gguf.GGML_QUANT_SIZES[QType.IQ2_XXS]
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    blocks[:, :2] = np.array([0.01], dtype=np.float16).view(np.uint8).reshape(1, 2)  # d
    return blocks.reshape(rows, cols // block * type_size)


def _write_unsupported_arch(path: str | os.PathLike[str]) -> None:
    cfg = make_config("llama")
    vocab = build_vocab(cfg)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(os.fspath(path), "mamba")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(1)
    _add_vocab(w, vocab, None)
    w.add_tensor("token_embd.weight", _linear(rng, len(vocab.tokens), cfg.hidden_size))
    w.add_tensor("output_norm.weight", _norm(rng, cfg.hidden_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _truncate_in_tensor_data(path: str | os.PathLike[str]) -> None:
    reader = gguf.GGUFReader(os.fspath(path))
    start = min(int(t.data_offset) for t in reader.tensors)
    del reader  # release the memmap before rewriting the file
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate((start + size) // 2)


def write_bad_gguf(path: str | os.PathLike[str], kind: str) -> None:
    """Write a file the loader must reject; `kind` is one of BAD_KINDS.

    unsupported_arch: a well-formed GGUF for "mamba"; unsupported_type: tiny llama whose
    blk.0.ffn_down.weight is IQ2_XXS; missing_tensor: no blk.0.ffn_up.weight; shape_mismatch:
    blk.0.attn_q.weight has head_dim extra output rows; truncated: valid file cut halfway through
    the tensor data; not_gguf: a text file.
    """
    if kind not in BAD_KINDS:
        raise ValueError(f"unknown bad-file kind {kind!r}; choose one of {BAD_KINDS}")
    if kind == "not_gguf":
        with open(path, "w", encoding="utf-8") as f:
            f.write("This is not a GGUF file, just some text a user might point the app at.\n")
        return
    if kind == "unsupported_arch":
        _write_unsupported_arch(path)
        return
    if kind == "truncated":
        write_tiny_gguf(path, "llama")
        _truncate_in_tensor_data(path)
        return
    # IQ2_XXS needs rows of whole 256-value blocks: ffn_down's rows are intermediate_size long.
    cfg = make_config("llama", intermediate_size=256 if kind == "unsupported_type" else 128)
    vocab = build_vocab(cfg)
    tensors = build_tensors(cfg, len(vocab.tokens), seed=0)
    encoded = _encode_all(tensors, "F32")
    if kind == "missing_tensor":
        del encoded["blk.0.ffn_up.weight"]
    elif kind == "shape_mismatch":
        rows = cfg.num_heads * cfg.head_dim + cfg.head_dim
        encoded["blk.0.attn_q.weight"] = (_linear(np.random.default_rng(1), rows, cfg.hidden_size), None)
    else:  # unsupported_type
        down = tensors["blk.0.ffn_down.weight"]
        encoded["blk.0.ffn_down.weight"] = (
            _iq2_xxs_bytes(np.random.default_rng(1), *down.shape), QType.IQ2_XXS)
    _write_file(path, "llama", cfg, vocab, encoded)
