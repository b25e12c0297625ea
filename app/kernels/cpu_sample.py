"""The sampler's draw for fp32 CPU rows in C (`cpu_sample.c`), and its torch reference.

A row's tokens get probabilities exp((logit - max) / temperature); top-k, then top-p (over the
top-k tokens' mass), then min-p (against the largest) keep a prefix of them ordered by probability,
highest first, equal ones by token id; a row with none of those filters keeps the whole vocabulary
in token-id order. The draw is the first token whose running mass passes `uniform` times the kept
mass. Both functions compute exactly that, so the C kernel's tokens can be checked against the
reference; the sampler's torch path (CUDA, no C compiler) draws from the same distribution in
token-id order."""

from __future__ import annotations

import ctypes
import functools

import torch

from app.kernels import cpu_build


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_build.load({"sample_rows": [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]})


def takes(logits: torch.Tensor) -> bool:
    """Whether `logits` `[rows, vocab]` can be drawn from here: fp32 on the CPU, the library built."""
    return logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and _library() is not None


def sample(logits: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
           uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of `logits` (see the module doc); `temps` > 0, `top_ks` 0 for off,
    `top_ps` >= 1 for off, `min_ps` 0 for off, `uniforms` float64 in [0, 1). Needs `takes(logits)`."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    args = (torch.tensor(temps, dtype=torch.float32), torch.tensor(top_ks, dtype=torch.int64),
            torch.tensor(top_ps, dtype=torch.float32), torch.tensor(min_ps, dtype=torch.float32),
            uniforms.to(torch.float64).contiguous())
    if _library().sample_rows(logits.data_ptr(), rows, vocab, *(a.data_ptr() for a in args), out.data_ptr()):
        raise MemoryError(f"no memory for the sampler's scratch ({vocab} tokens a row)")
    return out


def sample_ref(logits: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float],
               min_ps: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """`sample` in torch, a row at a time (a full sort: for tests)."""
    out = [_sample_row_ref(row, t, k, p, m, float(u))
           for row, t, k, p, m, u in zip(logits.float(), temps, top_ks, top_ps, min_ps, uniforms)]
    return torch.tensor(out, dtype=torch.int64)


def _sample_row_ref(row: torch.Tensor, temp: float, k: int, p: float, min_p: float, u: float) -> int:
    vocab = row.shape[0]
    top = row.max()
    if top == float("inf"):
        probs = (row == top).float()
    else:
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temp, dtype=torch.float32)
        probs = torch.nan_to_num(torch.exp((row - top) * inv), nan=0.0)
    total = _lane_sum(probs)
    if not total > 0:
        return 0  # every logit -inf
    k = k if 0 < k < vocab else 0
    if k == 0 and p >= 1.0 and min_p <= 0.0:
        cdf = probs.double().cumsum(0)
        passed = (cdf > u * total) & (probs > 0)
        return int(passed.nonzero()[0]) if bool(passed.any()) else int((probs > 0).nonzero()[-1])
    ids = (probs > 0).nonzero().squeeze(1)
    order = torch.sort(probs[ids], descending=True, stable=True).indices  # equal ones: lower id first
    ids, kept = ids[order], probs[ids][order].double()
    keep = min(k, len(ids)) if k else len(ids)
    mass = float(kept[:keep].cumsum(0)[-1]) if k else total
    if p < 1.0:
        before = torch.cat([kept.new_zeros(1), kept[: keep - 1].cumsum(0)])
        cut = (before >= p * mass).nonzero()
        keep = int(cut[0]) if len(cut) else keep
    low = (kept[:keep] < min_p).nonzero()
    keep = max(int(low[0]) if len(low) else keep, 1)
    running = kept[:keep].cumsum(0)
    passed = (running > u * float(running[-1])).nonzero()
    return int(ids[int(passed[0]) if len(passed) else keep - 1])


def _lane_sum(probs: torch.Tensor) -> float:
    """A row's sum as the C kernel takes it: eight running lanes (token i in lane i % 8), then
    across them in lane order."""
    padded = torch.nn.functional.pad(probs.double(), (0, -probs.shape[0] % 8))
    return float(padded.view(-1, 8).cumsum(0)[-1].cumsum(0)[-1])
