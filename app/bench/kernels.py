"""`localbatch bench kernels`: how near each quant type's prompt GEMM (app/kernels/cpu_qgemm.c)
comes to this CPU's arithmetic peak.

The peaks first (app/kernels/cpu_peak.c, built with the kernels): int8 multiply-accumulates a second
with the instruction the GEMM tiles use here (vpdpbusd on zmm where the CPU has AVX-512 VNNI, else
vpmaddubsw + vpmaddwd), and fp32 FMAs. Then each type's GEMM at a catalog model's matrix shapes
(q, k, v, o, gate, up, down of one layer) for prompt chunks of a few sizes, with 1 and 2 threads:
GMAC/s, per matrix and for the layer (its MACs over the sum of its matrices' times), and that as a
share of the int8 peak with as many threads. Random weights: the kernels' time does not depend on
the values. Each figure is the best of `--repeats` runs (the least disturbed by other processes).

    localbatch bench kernels
    localbatch bench kernels --types Q4_K,Q6_K --rows 512 --threads 2 --json kernels.json

Nothing here imports torch until a run starts (`--help` stays cheap)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The matrix sizes of one layer of a catalog model."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def matrices(self) -> dict[str, tuple[int, int]]:
        """Each matrix's (N out, K in), in forward order."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}


MODELS: dict[str, ModelShape] = {
    "qwen2.5-coder-1.5b-instruct": ModelShape(1536, 8960, 12, 2, 128),
    "qwen2.5-coder-0.5b-instruct": ModelShape(896, 4864, 14, 2, 64),
    "smollm2-135m-instruct": ModelShape(576, 1536, 9, 3, 64),
}

# Each GGUF type as the C kernels hold it (app/engine/runtime/weight_forms.py): the form's name, and
# the multiple of 256 a K-quant's rows need (the form refuses other widths).
TYPES: dict[str, tuple[str, int]] = {
    "Q4_K": ("q4k", 256), "Q5_K": ("q5", 32), "Q6_K": ("q6", 256), "Q8_0": ("q8", 32),
    "Q4_0": ("q4_0", 32), "Q5_0": ("q5_0", 32), "IQ4_NL": ("q8", 32),
}
# What the C GEMM has no kernel of its own for, and takes as another form.
NOT_NATIVE = {"Q5_K": "its 5-bit levels with d * scale and the min folded per group of 32 (the q5 kernel)",
              "IQ4_NL": "8-bit groups (the q8 kernel): the non-linear grid has no integer kernel"}
DEFAULT_ROWS = (64, 256, 512)
DEFAULT_THREADS = (1, 2)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=next(iter(MODELS)), help="comma list of: " + ", ".join(MODELS) + " (or 'all')")
    p.add_argument("--types", default=",".join(TYPES), help="comma list of GGUF types: " + ", ".join(TYPES))
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="prompt chunk sizes (rows of x), comma list")
    p.add_argument("--threads", default=",".join(map(str, DEFAULT_THREADS)), help="thread counts, comma list")
    p.add_argument("--repeats", type=int, default=3, help="runs of each GEMM; the best counts")
    p.add_argument("--peak-seconds", type=float, default=0.3, help="about how long each peak loop runs")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: the process's CPU time over the threads (on a machine other "
                        "processes keep busy: the time this one ran, peaks and GEMMs alike)")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str, known: dict[str, Any], what: str) -> list[str]:
    names = list(known) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        from app.engine.types.errors import LocalbatchError

        raise LocalbatchError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def cases(models: list[str], types: list[str]) -> list[dict[str, Any]]:
    """Every (model, type, matrix) the run measures, with the reason where a type cannot take a
    matrix (a K-quant's rows are whole blocks of 256)."""
    out = []
    for model in models:
        for gguf_type in types:
            form, multiple = TYPES[gguf_type]
            for name, (n, k) in MODELS[model].matrices().items():
                skip = f"K={k} is not a multiple of {multiple}" if k % multiple else None
                out.append({"model": model, "type": gguf_type, "form": form, "matrix": name, "N": n, "K": k,
                            "skip": skip})
    return out


def make_weight(form: str, n: int, k: int, seed: int = 0):  # noqa: ANN201 (a cpu_qgemm weight)
    """A random matrix in the kernels' `form` (the values do not change the time)."""
    import torch

    from app.kernels.cpu_qgemm import Q4KWeight, Q4Weight, Q5Weight, Q6Weight, Q8Weight

    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 1e-3 + 1e-4
    if form == "q4k":
        blocks = torch.rand(n, k // 256, generator=g) * 1e-3
        sm = [torch.randint(0, 64, (n, k // 32), generator=g).to(torch.uint8) for _ in range(2)]
        return Q4KWeight(torch.randint(0, 16, (n, k), generator=g), blocks, blocks, *sm)
    if form == "q6":
        return Q6Weight(torch.randint(0, 64, (n, k), generator=g).to(torch.uint8),
                        torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8),
                        d[:, ::8].repeat_interleave(8, -1))
    if form in ("q4", "q4_0"):
        return Q4Weight(torch.randint(0, 16, (n, k), generator=g), d, -8 * d.half().float() if form == "q4_0" else -d)
    if form in ("q5", "q5_0"):
        return Q5Weight(torch.randint(0, 32, (n, k), generator=g), d, -16 * d.half().float() if form == "q5_0" else -d)
    return Q8Weight(torch.randn(n, k, generator=g) * 0.05)


def _peak_fn() -> Callable[[int, int, int], int]:
    import ctypes

    from app.kernels import cpu_build

    lib = cpu_build.load({"qpeak": [ctypes.c_int, ctypes.c_int64, ctypes.c_int]}, restypes={"qpeak": ctypes.c_int64})
    if lib is None:
        from app.engine.types.errors import LocalbatchError

        raise LocalbatchError(f"the C kernels are off here ({cpu_build.library().reason}): nothing to measure")
    return lib.qpeak


def clock(kind: str, threads: int) -> Callable[[], float]:
    """Seconds as `--clock` counts them: elapsed, or the process's CPU time over `threads` (one
    thread: its own CPU time, nothing of the interpreter's other threads)."""
    if kind == "wall":
        return time.perf_counter
    if threads == 1:
        return time.thread_time
    return lambda: time.process_time() / threads


def peak_gmacs(kind: str, threads: int, seconds: float, repeats: int = 3, clock_kind: str = "wall") -> float:
    """The best GMAC/s of the `kind` ("int8" or "fp32") loop on `threads` threads."""
    qpeak, now = _peak_fn(), clock(clock_kind, threads)
    code = 0 if kind == "int8" else 1
    iters = 1 << 14
    while True:  # grow the loop until one run takes about `seconds`
        t = now()
        macs = qpeak(code, iters, threads)
        elapsed = now() - t
        if elapsed >= seconds / 4 or iters >= 1 << 30:
            break
        iters *= 4
    best = macs / elapsed
    for _ in range(repeats - 1):
        t = now()
        macs = qpeak(code, iters, threads)
        best = max(best, macs / max(now() - t, 1e-9))
    return best / 1e9


def gemm_seconds(weight, rows: int, repeats: int, now: Callable[[], float] = time.perf_counter) -> float:  # noqa: ANN001
    """The best of `repeats` timed calls of `weight` (a cpu_qgemm weight) on `rows` random rows,
    after one untimed."""
    import torch

    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    weight(x)
    best = float("inf")
    for _ in range(repeats):
        t = now()
        weight(x)
        best = min(best, now() - t)
    return best


def measure(models: list[str], types: list[str], rows: list[int], threads: list[int], repeats: int,
            peaks: dict[int, float], log: Callable[[str], None] = print, clock_kind: str = "wall") -> list[dict[str, Any]]:
    """One row per (model, type, rows, threads): the layer's GMAC/s and share of the int8 peak,
    and each matrix's GMAC/s (None where the type cannot hold it)."""
    import torch

    saved = torch.get_num_threads()
    out = []
    try:
        todo = cases(models, types)
        for model in models:
            for gguf_type in types:
                mine = [c for c in todo if c["model"] == model and c["type"] == gguf_type]
                skipped = sorted({c["skip"] for c in mine if c["skip"]})
                weights = {c["matrix"]: make_weight(c["form"], c["N"], c["K"]) for c in mine if not c["skip"]}
                for t in threads:
                    torch.set_num_threads(t)
                    for m in rows:
                        row: dict[str, Any] = {"model": model, "type": gguf_type, "rows": m, "threads": t}
                        macs = secs = 0.0
                        for name, w in weights.items():
                            s = gemm_seconds(w, m, repeats, clock(clock_kind, t))
                            mac = m * w.in_features * w.out_features
                            row[name] = round(mac / s / 1e9, 1)
                            macs, secs = macs + mac, secs + s
                        row["layer_gmacs"] = round(macs / secs / 1e9, 1) if secs else None
                        row["pct_peak"] = round(100 * macs / secs / 1e9 / peaks[t], 1) if secs else None
                        row["skipped"] = "; ".join(skipped) or None
                        out.append(row)
                        log(_line(row))
    finally:
        torch.set_num_threads(saved)
    return out


def _line(row: dict[str, Any]) -> str:
    per = " ".join(f"{k}={row[k]}" for k in ("q", "k", "v", "o", "gate", "up", "down") if k in row)
    pct = "-" if row["pct_peak"] is None else f"{row['pct_peak']:5.1f}%"
    return (f"{row['model'][:22]:22} {row['type']:6} rows={row['rows']:<4} t={row['threads']} "
            f"layer {row['layer_gmacs'] or '-':>6} GMAC/s {pct} of int8 peak   {per}"
            + (f"   (skipped: {row['skipped']})" if row["skipped"] else ""))


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    from app.kernels import cpu_qgemm

    models = _names(args.models, MODELS, "model")
    types = _names(args.types, TYPES, "type")
    rows, threads = _ints(args.rows), _ints(args.threads)
    isa = cpu_qgemm.isa()
    peaks = {t: peak_gmacs("int8", t, args.peak_seconds, clock_kind=args.clock) for t in threads}
    fp32 = {t: peak_gmacs("fp32", t, args.peak_seconds, clock_kind=args.clock) for t in threads}
    log(f"GEMM tiles: {isa}; int8 peak " + ", ".join(f"{peaks[t]:.1f} GMAC/s at {t} thread(s)" for t in threads)
        + "; fp32 FMA peak " + ", ".join(f"{fp32[t]:.1f} at {t}" for t in threads))
    for gguf_type in types:
        if gguf_type in NOT_NATIVE:
            log(f"{gguf_type}: no kernel of its own; runs as {NOT_NATIVE[gguf_type]}")
    table = measure(models, types, rows, threads, args.repeats, peaks, log, args.clock)
    return {"isa": isa, "int8_peak_gmacs": {str(t): round(v, 1) for t, v in peaks.items()},
            "fp32_peak_gmacs": {str(t): round(v, 1) for t, v in fp32.items()},
            "not_native": {t: NOT_NATIVE[t] for t in types if t in NOT_NATIVE}, "rows": table}
