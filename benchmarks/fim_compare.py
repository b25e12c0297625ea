"""Code completion against llama-server: does `localbatch serve`'s `/infill` give the same greedy
middle, and how fast is a follow-up request after a one-line edit near the cursor?

    python benchmarks/fim_compare.py --model qwen2.5-coder-1.5b-instruct [--prompts 20] [--followups 12]
        [--llama-server ~/.cache/localbatch-anchor/llama.cpp/build/bin/llama-server]

Each server runs alone (one after the other, 2 threads each), on the same GGUF, with the same
requests through `/infill`:
- equality: `--prompts` FIM requests cut from this repository's sources (30 lines before the
  cursor, 10 after, the rest of the line as the start of the middle dropped), greedy, 16 tokens;
  the contents compared;
- follow-ups: one file of about 2,000 tokens (an extra chunk from another file, the prefix, 40
  lines of suffix), then `--followups` requests each after a one-line edit just above the cursor,
  as an editor sends at every pause: time to first token (streamed) and `tokens_cached` per request.
Prints one JSON line per server and a summary. Linux only; the llama-server binary is the one
`../shared/bench/llama_cpp_anchor.sh` builds (`cmake --build … --target llama-server`)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import overhead
DEFAULT_LLAMA = Path.home() / ".cache/localbatch-anchor/llama.cpp/build/bin/llama-server"


def cut_points(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs: a cursor at the start of a non-blank line in one of app/'s files."""
    rng = random.Random(seed)
    files = sorted(p for p in (ROOT / "app").rglob("*.py") if p.stat().st_size > 4000)
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text().splitlines(keepends=True)
        i = rng.randrange(30, len(lines) - 10)
        if not lines[i].strip():
            continue
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        out.append(("".join(lines[i - 30:i]) + indent, "".join(lines[i + 1:i + 11])))
    return out


def followup_requests(count: int) -> list[dict]:
    """One file edited near the cursor between requests: the prefix grows by a comment each time."""
    main = (ROOT / "app/ui/chat.py").read_text().splitlines(keepends=True)
    extra = {"filename": "app/ui/store.py", "text": "".join((ROOT / "app/ui/store.py").read_text().splitlines(True)[:60])}
    cursor = 170
    prefix, suffix = "".join(main[cursor - 120:cursor]), "".join(main[cursor:cursor + 40])
    requests = []
    for k in range(count):
        edited = prefix + "".join(f"        # step {j}\n" for j in range(k))  # the line typed just above the cursor
        requests.append({"input_extra": [extra], "input_prefix": edited + "        ", "input_suffix": suffix})
    return requests


def infill(client: httpx.Client, url: str, body: dict, stream: bool) -> dict:
    """One /infill; with `stream`, the time to the first content and the last event's fields."""
    body = {"n_predict": 16, "temperature": 0.0, "top_k": 1, "cache_prompt": True, "stream": stream, **body}
    start = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/infill", json=body)
        r.raise_for_status()
        return {**r.json(), "latency_s": time.perf_counter() - start}
    first, content, last = None, "", {}
    with client.stream("POST", f"{url}/infill", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content") and first is None:
                first = time.perf_counter() - start
            content += event.get("content", "")
            last = event
    return {**last, "content": content, "ttft_s": first, "latency_s": time.perf_counter() - start}


def run(name: str, url: str, cuts: list[tuple[str, str]], follow: list[dict]) -> dict:
    with httpx.Client(timeout=600) as client:
        contents = [infill(client, url, {"input_prefix": p, "input_suffix": s}, stream=False)["content"] for p, s in cuts]
        runs = [infill(client, url, body, stream=True) for body in follow]
    ttfts = [r["ttft_s"] for r in runs[1:] if r["ttft_s"] is not None]  # the first reads the whole file
    return {"server": name, "contents": contents, "first_ttft_s": runs[0]["ttft_s"],
            "followup_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "followup_latency_p50_s": statistics.median(r["latency_s"] for r in runs[1:]),
            "tokens_cached": [r.get("tokens_cached") for r in runs],
            "prompt_n": [r.get("timings", {}).get("prompt_n") for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--followups", type=int, default=12)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)
    p.add_argument("--port", type=int, default=8077)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from app.engine.gguf.catalog import installed_path

    gguf = installed_path(args.model) or args.model
    cuts, follow = cut_points(args.prompts), followup_requests(args.followups)
    url = f"http://127.0.0.1:{args.port}"
    results = []
    for name, cmd in (
        ("localbatch", [sys.executable, "-m", "app.cli", "serve", "--model", str(gguf), "--device", "cpu",
                        "--port", str(args.port)]),
        ("llama-server", [str(args.llama_server), "-m", str(gguf), "-t", str(os.cpu_count() or 2), "-c", "8192",
                          "--port", str(args.port), "-np", "1"]),
    ):
        proc = overhead.start_server(cmd, url)
        try:
            results.append(run(name, url, cuts, follow))
        finally:
            proc.terminate()
            proc.wait(30)
        print(json.dumps({k: v for k, v in results[-1].items() if k != "contents"}), flush=True)
    ours, theirs = (r["contents"] for r in results)
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy middles equal: {same}/{len(ours)}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            print(f"  #{i}: localbatch {a!r} / llama-server {b!r}")
    lb, ll = results
    if lb["followup_ttft_p50_s"] and ll["followup_ttft_p50_s"]:
        print(f"follow-up TTFT p50: localbatch {lb['followup_ttft_p50_s'] * 1000:.0f} ms, llama-server "
              f"{ll['followup_ttft_p50_s'] * 1000:.0f} ms (ratio {lb['followup_ttft_p50_s'] / ll['followup_ttft_p50_s']:.2f})")


if __name__ == "__main__":
    main()
