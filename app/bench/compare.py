"""`localbatch bench compare`: localbatch against llama.cpp on the same GGUF, back to back, on this
machine.

Decode: llama.cpp's `llama-batched-bench` (128-token prompts, 64 generated, all cores) and
`localbatch bench throughput --concurrency` with the same workload, in fresh processes; decode
tok/s of both (the steps where all of a level's sequences decode together: S_TG's count) and
their ratio per concurrency, the scaling curve in the terminal, and (`--svg`) as
an SVG for the README. Prefill (`--prefill-len`): one prompt of each length to its first token on
both (llama.cpp's S_PP; localbatch's prompt over its median TTFT), then 32 tokens decoded after it
(the decode rate at that context). `--rounds N` repeats each pair N times, alternating which engine
goes first, and reports the median of each figure and of the per-round ratios.

llama.cpp's binary is the one `localbatch bench setup-llama-cpp` builds (`app.bench.llama_cpp`), or
the one in `--llama-cpp DIR`. Nothing else should run meanwhile: on two cores any other process shows up in both figures."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from app.bench.paired import alternate

LONG_GEN = 32  # tokens decoded after each timed prompt: the decode rate at that context
# The workload of both sides (and `localbatch bench`'s defaults).
PROMPT_LEN, GEN_LEN = 128, 64


def batched_bench_rows(output: str) -> list[list[str]]:
    """The result rows of llama-batched-bench's table: PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in output.splitlines()
            if line.startswith("|") and line.split("|")[1].strip().isdigit()]


def run_llama_cpp(binary: str, model: str, batches: list[int]) -> dict[int, float]:
    """llama.cpp's decode tok/s (S_TG) per batch size."""
    cmd = [binary, "-m", model, "-c", "16384", "-b", "2048", "-ub", "512", "-npp", str(PROMPT_LEN),
           "-ntg", str(GEN_LEN), "-npl", ",".join(map(str, batches)), "-t", str(os.cpu_count() or 1)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(r[2]): float(r[7]) for r in batched_bench_rows(out)}


def _localbatch(model: str, extra: list[str], *args: str) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "bench", "throughput", "--model", model, *args, "--range-ratio", "0",
           "--json", "-", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_localbatch(model: str, batches: list[int], extra: list[str]) -> dict[int, float]:
    """localbatch's decode tok/s per batch size, as S_TG counts it: steps where all the level's
    sequences decode together. batched-bench reads every prompt before decoding; the default
    prefill budget reads them beside the first replies' decodes, so some replies can end before
    the batch is ever whole: the budget is off here (`extra` may turn it back on)."""
    report = _localbatch(model, ["--itl-target-ms", "0", *extra], "--input-len", str(PROMPT_LEN), "--output-len",
                         str(GEN_LEN), "--num-prompts", "2", "--concurrency", ",".join(map(str, batches)))
    return {s["concurrency"]: float(s["full_batch_tok_s"]) for s in report["sweep"]}


def prefill_llama_cpp(model: str, prompt_len: int, binary: str = "llama-batched-bench") -> tuple[float, float]:
    """llama.cpp's prompt tok/s for one prompt of `prompt_len` tokens and its decode tok/s after it
    (S_PP and S_TG of batched-bench)."""
    cmd = [binary, "-m", model, "-c", str(prompt_len + LONG_GEN + 64), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(LONG_GEN), "-npl", "1", "-t", str(os.cpu_count() or 1)]
    row = batched_bench_rows(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[0]
    return float(row[5]), float(row[7])


def prefill_localbatch(model: str, prompt_len: int, extra: list[str]) -> tuple[float, float]:
    """localbatch's prompt tok/s for one prompt of `prompt_len` tokens (the prompt over its time to
    first token, median of three prompts run one after another), and its decode tok/s after it."""
    report = _localbatch(model, extra, "--input-len", str(prompt_len), "--output-len", str(LONG_GEN),
                         "--num-prompts", "3", "--concurrency", "1")
    row = report["sweep"][0]
    return prompt_len / (row["ttft_ms_p50"] / 1000), float(row["decode_tok_s"])


def prefill_row(prompt_tokens: int, pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> dict:
    """One prompt length's figures over its rounds ((llama.cpp, localbatch) per round, each
    (prompt tok/s, decode tok/s)): medians, and the median of the per-round ratios."""
    peer_pp, ours_pp = statistics.median([p[0][0] for p in pairs]), statistics.median([p[1][0] for p in pairs])
    return {"prompt_tokens": prompt_tokens, "localbatch_tok_s": round(ours_pp, 1), "llama_cpp_tok_s": round(peer_pp, 1),
            "ratio": round(statistics.median([p[1][0] / p[0][0] for p in pairs]), 3),
            "localbatch_ttft_s": round(prompt_tokens / ours_pp, 2), "llama_cpp_ttft_s": round(prompt_tokens / peer_pp, 2),
            "localbatch_decode_tok_s": round(statistics.median([p[1][1] for p in pairs]), 1),
            "llama_cpp_decode_tok_s": round(statistics.median([p[0][1] for p in pairs]), 1),
            "decode_ratio": round(statistics.median([p[1][1] / p[0][1] for p in pairs]), 3)}


def run_compare(model: str, binary: str, batches: list[int], prefill_lens: list[int], rounds: int,
                extra: list[str]) -> dict:
    """Both engines `rounds` times per workload, alternating which goes first; medians."""
    report: dict = {"model": model, "rounds": rounds}
    if batches:
        pairs = alternate(lambda: run_llama_cpp(binary, model, batches),
                          lambda: run_localbatch(model, batches, extra), rounds)
        rows = []
        for b in batches:
            ratios = [ours.get(b, 0.0) / peer[b] if peer.get(b) else 0.0 for peer, ours in pairs]
            peer = statistics.median(p.get(b, 0.0) for p, _ in pairs)
            rows.append({"concurrency": b, "localbatch_tok_s": statistics.median(o.get(b, 0.0) for _, o in pairs),
                         "llama_cpp_tok_s": peer, "ratio": round(statistics.median(ratios), 3) if peer else None,
                         "round_ratios": [round(r, 3) for r in ratios]})
        report["rows"] = rows
    if prefill_lens:
        report["prefill"] = [prefill_row(n, alternate(lambda: prefill_llama_cpp(model, n, binary),  # noqa: B023
                                                      lambda: prefill_localbatch(model, n, extra), rounds))  # noqa: B023
                             for n in prefill_lens]
    return report


def format_report(report: dict) -> str:
    rows = [(r["concurrency"], r["localbatch_tok_s"], r["llama_cpp_tok_s"]) for r in report.get("rows", [])]
    parts = [format_table(rows)] if rows else []
    if report.get("rounds", 1) > 1:
        parts += [f"c={r['concurrency']:<3} ratio per round: {' '.join(f'{x:.2f}' for x in r['round_ratios'])}, "
                  f"median {r['ratio'] or 0:.2f}" for r in report.get("rows", [])]
    parts += [f"prefill, one {pp['prompt_tokens']}-token prompt: localbatch {pp['localbatch_tok_s']:.1f} tok/s "
              f"({pp['localbatch_ttft_s']:.2f} s), llama.cpp {pp['llama_cpp_tok_s']:.1f} tok/s ({pp['llama_cpp_ttft_s']:.2f} s): "
              f"{pp['ratio']:.2f}x; then decode {pp['localbatch_decode_tok_s']:.1f} against {pp['llama_cpp_decode_tok_s']:.1f} "
              f"tok/s: {pp['decode_ratio']:.2f}x" for pp in report.get("prefill", [])]
    if rows:
        parts += ["", terminal_chart(rows)]
    return "\n".join(parts)


def format_table(rows: list[tuple[int, float, float]]) -> str:
    lines = ["concurrency   localbatch   llama.cpp   ratio", "-" * 44]
    for b, ours, peer in rows:
        ratio = f"{ours / peer:5.2f}x" if peer else "    -"
        lines.append(f"{b:>11}   {ours:10.1f}   {peer:9.1f}   {ratio}")
    return "\n".join(lines)


def terminal_chart(rows: list[tuple[int, float, float]], width: int = 50) -> str:
    """Decode tok/s against concurrency, one bar per engine and concurrency."""
    top = max([v for _, o, p in rows for v in (o, p)] + [1.0])
    lines = ["decode tok/s (█ localbatch, ░ llama.cpp)"]
    for b, ours, peer in rows:
        lines.append(f"{b:>3} │{'█' * round(ours / top * width):<{width}} {ours:7.1f}")
        lines.append(f"    │{'░' * round(peer / top * width):<{width}} {peer:7.1f}")
    return "\n".join(lines)


def scaling_svg(rows: list[tuple[int, float, float]], model: str, cpu: str) -> str:
    """A small line chart (no plotting library needed): x = concurrency, y = decode tok/s."""
    w, h, left, bottom, top_pad, right = 640, 360, 60, 40, 40, 20
    xs = [b for b, _, _ in rows]
    ymax = max([v for _, o, p in rows for v in (o, p)] + [1.0]) * 1.1
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
        f'{line([o for _, o, _ in rows], "#1f77b4")}{line([p for _, _, p in rows], "#ff7f0e")}'
        f'<text x="{left + 10}" y="{top_pad + 10}" fill="#1f77b4">localbatch</text>'
        f'<text x="{left + 10}" y="{top_pad + 26}" fill="#ff7f0e">llama.cpp</text></svg>'
    )


def write_svg(path: Path, report: dict, cpu: str) -> None:
    rows = [(r["concurrency"], r["localbatch_tok_s"], r["llama_cpp_tok_s"]) for r in report.get("rows", [])]
    path.write_text(scaling_svg(rows, Path(report["model"]).stem, cpu))
