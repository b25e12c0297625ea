"""Would llama.cpp's Q8_K activations (one scale per 256, group scales applied as integers) lift the
VNNI panels' Q4_K and Q6_K toward the int8 peak?

Times the panels' inner loop in both arithmetics (q8k_panel.c beside this file: the app's register
tile, the panels and 512 rows of levels in cache, one thread, CPU time) and reads the int8 peak the
same way (`localbatch bench kernels`' loop). The rest of a GEMM (unpacking, quantizing, memory) is
left out: a real kernel reaches about four fifths of its loop's figure (docs/benchmarks.md).
Needs AVX-512 VNNI and a C compiler.

    localbatch bench research q8k_panel --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from app.engine.types.errors import LocalbatchError

SOURCE = Path(__file__).with_name("q8k_panel.c")
# No AMX, whatever the compiler's default for the machine: only the listed extensions.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, help="rounds of the five loops (best of 200 runs each)")
    p.add_argument("--peak-seconds", type=float, default=0.5, help="length of the int8 peak loop's runs")


def _build(workdir: Path) -> Path:
    from app.kernels.cpu_info import cpu_flags

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or "avx512_vnni" not in cpu_flags():
        raise LocalbatchError("q8k_panel needs a C compiler and a CPU with AVX-512 VNNI")
    exe = workdir / "q8k_panel"
    subprocess.run([cc, *FLAGS, "-o", str(exe), str(SOURCE)], check=True)
    return exe


def run(args: argparse.Namespace) -> dict:
    from app.bench.kernels import peak_gmacs
    from app.kernels import cpu_qgemm

    if cpu_qgemm.isa() != "AVX-512 VNNI":
        raise LocalbatchError("q8k_panel compares the AVX-512 VNNI panels: this CPU's GEMM tiles are not those")
    peak = peak_gmacs("int8", 1, args.peak_seconds, clock_kind="cpu")
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        exe = _build(Path(d))
        for _ in range(args.repeats):
            for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
                name, gmacs = line.split("\t")
                best[name] = max(best.get(name, 0.0), float(gmacs))
    rows = [{"form": k, "gmacs": v, "pct_peak": round(100 * v / peak, 1)} for k, v in best.items()]
    print(f"int8 peak {peak:.1f} GMAC/s (1 thread)")
    for r in rows:
        print(f"{r['form']:16} {r['gmacs']:7.1f} GMAC/s  {r['pct_peak']:5.1f}% of the peak")
    return {"int8_peak_gmacs": round(peak, 1), "rows": rows}
