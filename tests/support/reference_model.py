"""A plain, independent fp32 torch forward of the supported GGUF decoders, llama.cpp semantics.

It reads the file with `gguf.GGUFReader` and dequantizes with `gguf.quants.dequantize` (not the
project's loader, so that a loader bug cannot hide in both sides) and recomputes the whole causal
sequence for positions 0..T-1 on every call. Slow and simple on purpose: it is the yardstick.

Run as a script to check it against the llama.cpp oracle for the embedded model:
    python tests/support/reference_model.py /tmp/gemma.gguf /work/shared/oracle/gemma3_270m.json
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# llama.cpp (llama_model_rope_type): LLAMA uses LLAMA_ROPE_TYPE_NORM, i.e. rotates adjacent pairs
# (2i, 2i+1): its converter permutes HF's q/k rows so that this equals HF's rotate_half. QWEN2,
# QWEN3 and GEMMA3 use LLAMA_ROPE_TYPE_NEOX, pairs (i, i + n_rot/2), on unpermuted weights.
_NEOX_ROPE = {"llama": False, "qwen2": True, "qwen3": True, "gemma3": True}
# llama.cpp: hparams.rope_freq_base_train_swa = 10000 for Gemma 3 (not stored in the GGUF).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp: hparams.set_swa_pattern(6) for Gemma 3: layer il is SWA iff il % 6 < 5.
GEMMA3_SWA_PATTERN = 6


@dataclass(frozen=True)
class HParams:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    n_rot: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    final_logit_softcapping: float
    vocab_size: int


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def read_hparams(reader: gguf.GGUFReader) -> HParams:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"reference model does not implement architecture {arch!r}")
    a = arch + "."
    hidden = int(_field(reader, a + "embedding_length"))
    heads = int(_field(reader, a + "attention.head_count"))
    head_dim = int(_field(reader, a + "attention.key_length", hidden // heads))
    window = int(_field(reader, a + "attention.sliding_window", 0)) if arch == "gemma3" else 0
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return HParams(
        arch=arch,
        hidden_size=hidden,
        num_layers=int(_field(reader, a + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        v_head_dim=int(_field(reader, a + "attention.value_length", head_dim)),
        n_rot=int(_field(reader, a + "rope.dimension_count", head_dim)),
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        sliding_window=window,
        # llama.cpp reads gemma3.final_logit_softcapping when present (Gemma 3 ships none).
        final_logit_softcapping=float(_field(reader, a + "final_logit_softcapping", 0.0)),
        vocab_size=int(embd.shape[1]),
    )


def read_tensors(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32, shaped in numpy order ([out, in] for matrices)."""
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        # Copy: the reader's arrays are read-only views of a memmap.
        out[t.name] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # ggml_rms_norm: x * 1/sqrt(mean(x^2) + eps) over the last dim, then ggml_mul by the weight
    # (Gemma's "+1" is already folded into the weight by llama.cpp's converter).
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float, neox: bool,
               n_rot: int | None = None) -> torch.Tensor:
    """RoPE on x [T, heads, head_dim] like ggml_rope_ext (no scaling): pair i turns by
    pos * base^(-2i/n_rot); only the first n_rot dims rotate, the rest pass through."""
    n_rot = x.shape[-1] if n_rot is None else n_rot
    half = n_rot // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / n_rot)
    theta = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cos(theta).to(x.dtype)[:, None, :]
    sin = torch.sin(theta).to(x.dtype)[:, None, :]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x0, x1 = rot[..., :half], rot[..., half:]
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    if neox:
        rotated = torch.cat([y0, y1], dim=-1)
    else:
        rotated = torch.stack([y0, y1], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def attention_mask(t: int, window: int) -> torch.Tensor:
    """Additive [T, T] mask: causal, and with window > 0 llama.cpp's LLAMA_SWA_TYPE_STANDARD rule
    (key p0 masked for query p1 when p1 - p0 >= n_swa), i.e. keys p-W < k <= p stay visible."""
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    visible = k <= q
    if window > 0:
        visible &= (q - k) < window
    mask = torch.zeros(t, t)
    return mask.masked_fill(~visible, float("-inf"))


class ReferenceModel:
    """Full-recompute fp32 forward of one sequence from a GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        reader = gguf.GGUFReader(os.fspath(path))
        self.hparams = read_hparams(reader)
        self.weights = read_tensors(reader)
        hp = self.hparams
        if hp.arch == "gemma3" and hp.sliding_window > 0:
            self.sliding_layers = [i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1
                                   for i in range(hp.num_layers)]
        else:
            self.sliding_layers = [False] * hp.num_layers

    def _w(self, name: str) -> torch.Tensor:
        try:
            return self.weights[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is missing from the GGUF") from None

    def _attention(self, i: int, h: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        hp, p = self.hparams, f"blk.{i}."
        t = h.shape[0]
        q, k, v = (h @ self._w(p + f"attn_{n}.weight").T for n in "qkv")
        # llama.cpp's llama/qwen2 graphs add q/k/v biases whenever the tensors exist.
        if p + "attn_q.bias" in self.weights:
            q, k, v = (x + self._w(p + f"attn_{n}.bias") for x, n in zip((q, k, v), "qkv"))
        q = q.view(t, hp.num_heads, hp.head_dim)
        k = k.view(t, hp.num_kv_heads, hp.head_dim)
        v = v.view(t, hp.num_kv_heads, hp.v_head_dim)
        if hp.arch in ("qwen3", "gemma3"):
            # QK-norm: per-head RMSNorm over head_dim, before RoPE (llm_build_qwen3 / gemma3).
            q = rms_norm(q, self._w(p + "attn_q_norm.weight"), hp.rms_norm_eps)
            k = rms_norm(k, self._w(p + "attn_k_norm.weight"), hp.rms_norm_eps)
        local = self.sliding_layers[i]
        base = GEMMA3_LOCAL_ROPE_BASE if local else hp.rope_theta
        q = apply_rope(q, positions, base, _NEOX_ROPE[hp.arch], hp.n_rot)
        k = apply_rope(k, positions, base, _NEOX_ROPE[hp.arch], hp.n_rot)
        # GQA as ggml_mul_mat broadcasts: query head j reads KV head j // (heads / kv_heads).
        group = hp.num_heads // hp.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        # Scale 1/sqrt(head_dim) = 1/sqrt(key_length): llama.cpp's default kq_scale, and Gemma 3's
        # f_attention_scale for every size but 27B.
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hp.head_dim)
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, hp.num_heads * hp.v_head_dim)
        return out @ self._w(p + "attn_output.weight").T

    def _ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = f"blk.{i}."
        gate = h @ self._w(p + "ffn_gate.weight").T
        up = h @ self._w(p + "ffn_up.weight").T
        # Gemma: LLM_FFN_GELU (ggml_gelu = tanh approximation); others: LLM_FFN_SILU; both
        # LLM_FFN_PAR (act(gate) * up).
        if self.hparams.arch == "gemma3":
            act = F.gelu(gate, approximate="tanh")
        else:
            act = F.silu(gate)
        return (act * up) @ self._w(p + "ffn_down.weight").T

    def final_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Hidden states after output_norm, [T, hidden] fp32, positions 0..T-1."""
        hp = self.hparams
        ids = torch.tensor(token_ids, dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= hp.vocab_size:
            raise ValueError(f"token ids must be a non-empty list in [0, {hp.vocab_size})")
        t = ids.numel()
        positions = torch.arange(t)
        x = self._w("token_embd.weight")[ids]
        if hp.arch == "gemma3":
            x = x * math.sqrt(hp.hidden_size)  # llm_build_gemma3: ggml_scale(inpL, sqrtf(n_embd))
        full_mask = attention_mask(t, 0)
        local_mask = attention_mask(t, hp.sliding_window)
        gemma = hp.arch == "gemma3"
        eps = hp.rms_norm_eps
        for i in range(hp.num_layers):
            p = f"blk.{i}."
            mask = local_mask if self.sliding_layers[i] else full_mask
            a = self._attention(i, rms_norm(x, self._w(p + "attn_norm.weight"), eps), positions, mask)
            if gemma:  # Gemma 2/3 sandwich norms on each branch output, before the residual add
                a = rms_norm(a, self._w(p + "post_attention_norm.weight"), eps)
            x = x + a
            f = self._ffn(i, rms_norm(x, self._w(p + "ffn_norm.weight"), eps))
            if gemma:
                f = rms_norm(f, self._w(p + "post_ffw_norm.weight"), eps)
            x = x + f
        return rms_norm(x, self._w("output_norm.weight"), eps)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for final hidden states; output.weight if present, else tied token_embd
        (llama.cpp falls back to tok_embd when the file has no output tensor)."""
        w = self.weights.get("output.weight", self._w("token_embd.weight"))
        logits = hidden @ w.T
        cap = self.hparams.final_logit_softcapping
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] for every position of one causal sequence."""
        return self.lm_head(self.final_hidden(token_ids))

    __call__ = forward


# ----------------------------------------------------------------------------------------------
# Oracle check (llama.cpp reference data; see /work/shared/oracle/README.md)
# ----------------------------------------------------------------------------------------------

@torch.inference_mode()
def teacher_forced_report(model: ReferenceModel, case: dict[str, Any], margin: float = 0.5,
                          chunk: int = 128) -> dict[str, float]:
    """Compare with one `teacher_forced` oracle case by the README's rule: over positions whose
    reference top-2 margin >= `margin`, argmax agreement and mean |logprob diff| of the
    reference top-1 token (also reported over all positions)."""
    ids = case["ids"]
    top5 = case["top5_logprobs"]
    hidden = model.final_hidden(ids)[: len(top5)]
    agree, diffs, kept = [], [], []
    for s in range(0, hidden.shape[0], chunk):
        logp = torch.log_softmax(model.lm_head(hidden[s:s + chunk]), dim=-1)
        for j in range(logp.shape[0]):
            ref = top5[s + j]
            ref_id, ref_lp = ref[0]
            agree.append(int(torch.argmax(logp[j])) == ref_id)
            diffs.append(abs(float(logp[j, ref_id]) - ref_lp))
            kept.append(ref[0][1] - ref[1][1] >= margin)
    sel = [i for i, k in enumerate(kept) if k]
    return {
        "positions": len(agree),
        "margin_positions": len(sel),
        "top1_agree_margin": sum(agree[i] for i in sel) / max(len(sel), 1),
        "mean_abs_logprob_diff_margin": sum(diffs[i] for i in sel) / max(len(sel), 1),
        "top1_agree_all": sum(agree) / len(agree),
        "mean_abs_logprob_diff_all": sum(diffs) / len(diffs),
        "max_abs_logprob_diff_all": max(diffs),
    }


@torch.inference_mode()
def greedy_report(model: ReferenceModel, cases: list[dict[str, Any]], margin: float = 0.3
                  ) -> dict[str, float]:
    """Compare with the oracle's `greedy` cases by the README's rule: feed prompt + output and,
    at steps whose reference top-2 margin >= `margin`, check argmax == reference top-1."""
    agree = steps = first_token_ok = 0
    for case in cases:
        prompt, output = case["prompt_ids"], case["output_ids"]
        ids = prompt + output
        logits = model.forward(ids[: len(prompt) + len(case["top5_logprobs"]) - 1])
        for i, ref in enumerate(case["top5_logprobs"]):
            pred = int(torch.argmax(logits[len(prompt) - 1 + i]))
            if i == 0:
                first_token_ok += pred == output[0]
            if ref[0][1] - ref[1][1] >= margin:
                steps += 1
                agree += pred == ref[0][0]
    return {"cases": len(cases), "margin_steps": steps,
            "top1_agree_margin": agree / max(steps, 1), "first_token_matches": first_token_ok}


def _main(argv: list[str]) -> int:
    import json
    import time

    if len(argv) != 2:
        print("usage: python tests/support/reference_model.py MODEL.gguf ORACLE.json", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = ReferenceModel(argv[0])
    t1 = time.perf_counter()
    with open(argv[1], encoding="utf-8") as f:
        oracle = json.load(f)
    for case in oracle["teacher_forced"]:
        print("teacher_forced", json.dumps(teacher_forced_report(model, case), indent=2))
    print("greedy", json.dumps(greedy_report(model, oracle["greedy"]), indent=2))
    t2 = time.perf_counter()
    print(f"load {t1 - t0:.1f} s, forward+compare {t2 - t1:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
