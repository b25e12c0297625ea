"""localbatch against llama.cpp on the same GGUF, back to back, on this machine.

    python benchmarks/compare_llama_cpp.py --model smollm2-135m-instruct [--batches 1,4,8,16]
        [--rounds 3] [--prefill-len 512,2048,4096] [--svg assets/scaling_smollm2.svg] [--json]

Runs `../shared/bench/llama_cpp_anchor.sh` (llama-batched-bench: 128-token prompts, 64 generated,
all cores; it builds llama.cpp once, ~10 min) and then `localbatch bench --concurrency` with the same
workload, prints the decode tok/s of both and their ratio per concurrency, draws the scaling curve
in the terminal, and writes it as an SVG for the README. Nothing else should run meanwhile: on two
cores any other process shows up in both figures.

`--prefill-len` times one prompt of each length to its first token on both engines, then 32 tokens
decoded after it: the prompt rate and the decode rate at that context (`--batches 0`: only these).

`--rounds N` repeats the pair N times, alternating which engine goes first, and reports the median
of each figure and of the per-round ratios: on a shared VM the machine's speed drifts by tens of
percent within a minute, so one pair of runs can favour either side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANCHOR = Path(os.environ.get("LLAMA_ANCHOR_SCRIPT", REPO.parent / "shared" / "bench" / "llama_cpp_anchor.sh"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF path or catalog name (default: the default model)")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--svg", type=Path, default=None, help="write the scaling curve here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--bench-args", default="", help="extra `localbatch bench` arguments, e.g. '--dtype float32'")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, alternating which goes first")
    p.add_argument("--prefill-len", default="512",
                   help="also time one prompt of each of these lengths (e.g. 512,2048,4096) to its first token, and "
                        f"then {LONG_GEN} tokens decoded after it (decode at that context); 0: skip")
    args = p.parse_args()
    from app.engine.gguf.catalog import resolve_model

    path = resolve_model(args.model)
    if path is None:
        from app.engine.gguf.default_model import default_model_path

        path = str(default_model_path())
    batches = [int(b) for b in args.batches.split(",") if b.strip() and int(b) > 0]  # none ("0"): prefill only
    prefill_lens = [int(n) for n in args.prefill_len.split(",") if int(n) > 0]
    # Other processes on a 2-core machine slow both engines unevenly (descheduled OpenMP threads
    # stall every parallel op): the load average before the runs says whether the figures count
    # (after them it is mostly the runs' own).
    load_before = os.getloadavg()[0]
    rounds = []  # (llama.cpp, localbatch) per round
    prefill = []  # (prompt tokens, llama.cpp, localbatch) per length and round: (prompt tok/s, decode tok/s) each
    extra = args.bench_args.split()
    for i in range(args.rounds):
        if batches and i % 2 == 0:
            peer_run = run_llama_cpp(path, args.batches)
            ours_run = run_localbatch(path, args.batches, extra)
        elif batches:
            ours_run = run_localbatch(path, args.batches, extra)
            peer_run = run_llama_cpp(path, args.batches)
        if batches:
            rounds.append((peer_run, ours_run))
        for n in prefill_lens:
            if i % 2 == 0:
                peer_pp = prefill_llama_cpp(path, n)
                ours_pp = prefill_localbatch(path, n, extra)
            else:
                ours_pp = prefill_localbatch(path, n, extra)
                peer_pp = prefill_llama_cpp(path, n)
            prefill.append((n, peer_pp, ours_pp))
    peer = {b: statistics.median(r[0].get(b, 0.0) for r in rounds) for b in batches}
    ours = {b: statistics.median(r[1].get(b, 0.0) for r in rounds) for b in batches}
    ratios = {b: [r[1].get(b, 0.0) / r[0][b] if r[0].get(b) else 0.0 for r in rounds] for b in batches}
    rows = [(b, ours[b], peer[b]) for b in batches]
    report = {"model": path, "cpu": cpu_name(), "load_1min_before": load_before, "rounds": args.rounds, "rows": [
        {"concurrency": b, "localbatch_tok_s": o, "llama_cpp_tok_s": l,
         "ratio": round(statistics.median(ratios[b]), 3) if l else None,
         "round_ratios": [round(r, 3) for r in ratios[b]]}
        for b, o, l in rows]}
    if prefill:
        report["prefill"] = [prefill_row(n, [(p[1], p[2]) for p in prefill if p[0] == n]) for n in prefill_lens]
    if args.svg:
        args.svg.write_text(scaling_svg(rows, Path(path).stem, report["cpu"]))
    load = f"load average (1 min) before the runs: {load_before:.2f}"
    per_round = "" if args.rounds == 1 else "\n" + "\n".join(
        f"c={b:<3} ratio per round: {' '.join(f'{r:.2f}' for r in ratios[b])}, median {statistics.median(ratios[b]):.2f}"
        for b in batches)
    pp_line = "".join(
        f"\nprefill, one {pp['prompt_tokens']}-token prompt: localbatch {pp['localbatch_tok_s']:.1f} tok/s "
        f"({pp['localbatch_ttft_s']:.2f} s), llama.cpp {pp['llama_cpp_tok_s']:.1f} tok/s ({pp['llama_cpp_ttft_s']:.2f} s): "
        f"{pp['ratio']:.2f}x; then decode {pp['localbatch_decode_tok_s']:.1f} against {pp['llama_cpp_decode_tok_s']:.1f} "
        f"tok/s: {pp['decode_ratio']:.2f}x"
        for pp in report.get("prefill", []))
    print(json.dumps(report) if args.json else format_table(rows) + per_round + pp_line + "\n" + load + "\n\n" + terminal_chart(rows))
    return 0


def run_llama_cpp(model: str, batches: str) -> dict[int, float]:
    out = subprocess.run(["bash", str(ANCHOR), model, batches], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(k): float(v) for k, v in data["decode_tok_s"].items()}


def run_localbatch(model: str, batches: str, extra: list[str]) -> dict[int, float]:
    cmd = [sys.executable, "-m", "app.cli", "bench", "--model", model, "--input-len", "128", "--output-len", "64",
           "--range-ratio", "0", "--num-prompts", "2", "--concurrency", batches, "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return {s["concurrency"]: float(s["decode_tok_s"]) for s in report["sweep"]}


def llama_bench_binary() -> Path:
    """Where the anchor script builds llama-batched-bench (it builds it on its first run)."""
    home = os.environ.get("LLAMA_ANCHOR_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localbatch-anchor"
    return Path(home) / "llama.cpp" / "build" / "bin" / "llama-batched-bench"


LONG_GEN = 32  # tokens decoded after each timed prompt: the decode rate at that context


def prefill_row(prompt_tokens: int, pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> dict:
    """One prompt length's figures over its rounds: medians, and the median of the per-round ratios."""
    peer_pp, ours_pp = statistics.median([p[0][0] for p in pairs]), statistics.median([p[1][0] for p in pairs])
    return {"prompt_tokens": prompt_tokens, "localbatch_tok_s": round(ours_pp, 1), "llama_cpp_tok_s": round(peer_pp, 1),
            "ratio": round(statistics.median([p[1][0] / p[0][0] for p in pairs]), 3),
            "localbatch_ttft_s": round(prompt_tokens / ours_pp, 2), "llama_cpp_ttft_s": round(prompt_tokens / peer_pp, 2),
            "localbatch_decode_tok_s": round(statistics.median([p[1][1] for p in pairs]), 1),
            "llama_cpp_decode_tok_s": round(statistics.median([p[0][1] for p in pairs]), 1),
            "decode_ratio": round(statistics.median([p[1][1] / p[0][1] for p in pairs]), 3)}


def prefill_llama_cpp(model: str, prompt_len: int) -> tuple[float, float]:
    """llama.cpp's prompt tok/s for one prompt of `prompt_len` tokens and its decode tok/s after it
    (S_PP and S_TG of batched-bench)."""
    cmd = [str(llama_bench_binary()), "-m", model, "-c", str(prompt_len + LONG_GEN + 64), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(LONG_GEN), "-npl", "1", "-t", str(os.cpu_count() or 1)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    return float(rows[0][5]), float(rows[0][7])


def prefill_localbatch(model: str, prompt_len: int, extra: list[str]) -> tuple[float, float]:
    """localbatch's prompt tok/s for one prompt of `prompt_len` tokens (the prompt over its time to
    first token, median of three prompts run one after another), and its decode tok/s after it."""
    cmd = [sys.executable, "-m", "app.cli", "bench", "--model", model, "--input-len", str(prompt_len), "--output-len", str(LONG_GEN),
           "--range-ratio", "0", "--num-prompts", "3", "--concurrency", "1", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    row = report["sweep"][0]
    return prompt_len / (row["ttft_ms_p50"] / 1000), float(row["decode_tok_s"])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def format_table(rows: list[tuple[int, float, float]]) -> str:
    lines = ["concurrency   localbatch   llama.cpp   ratio", "-" * 44]
    for b, ours, peer in rows:
        ratio = f"{ours / peer:5.2f}x" if peer else "    -"
        lines.append(f"{b:>11}   {ours:10.1f}   {peer:9.1f}   {ratio}")
    return "\n".join(lines)


def terminal_chart(rows: list[tuple[int, float, float]], width: int = 50) -> str:
    """Decode tok/s against concurrency, one bar per engine and concurrency."""
    top = max([v for _, o, l in rows for v in (o, l)] + [1.0])
    lines = ["decode tok/s (█ localbatch, ░ llama.cpp)"]
    for b, ours, peer in rows:
        lines.append(f"{b:>3} │{'█' * round(ours / top * width):<{width}} {ours:7.1f}")
        lines.append(f"    │{'░' * round(peer / top * width):<{width}} {peer:7.1f}")
    return "\n".join(lines)


def scaling_svg(rows: list[tuple[int, float, float]], model: str, cpu: str) -> str:
    """A small line chart (no plotting library needed): x = concurrency, y = decode tok/s."""
    w, h, left, bottom, top_pad, right = 640, 360, 60, 40, 40, 20
    xs = [b for b, _, _ in rows]
    ymax = max([v for _, o, l in rows for v in (o, l)] + [1.0]) * 1.1
    x_of = {b: left + i * (w - left - right) / max(len(xs) - 1, 1) for i, b in enumerate(xs)}

    def y(v: float) -> float:
        return h - bottom - v / ymax * (h - bottom - top_pad)

    def line(values: list[float], color: str) -> str:
        pts = " ".join(f"{x_of[b]:.1f},{y(v):.1f}" for b, v in zip(xs, values))
        dots = "".join(f'<circle cx="{x_of[b]:.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>' for b, v in zip(xs, values))
        return f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>{dots}'

    ticks = "".join(
        f'<text x="{x_of[b]:.1f}" y="{h - bottom + 16}" text-anchor="middle">{b}</text>' for b in xs
    ) + "".join(
        f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>'
        f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
        for v in (ymax * i / 4 for i in range(5))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
        f'<rect width="{w}" height="{h}" fill="white"/>{ticks}'
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">decode tok/s vs concurrency: {model}</text>'
        f'<text x="{w / 2}" y="{h - 6}" text-anchor="middle">concurrent sequences · {cpu}</text>'
        f'{line([o for _, o, _ in rows], "#1f77b4")}{line([l for _, _, l in rows], "#ff7f0e")}'
        f'<text x="{left + 10}" y="{top_pad + 10}" fill="#1f77b4">localbatch</text>'
        f'<text x="{left + 10}" y="{top_pad + 26}" fill="#ff7f0e">llama.cpp</text></svg>'
    )


if __name__ == "__main__":
    sys.exit(main())
