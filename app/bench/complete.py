"""`localbatch bench complete`: code completion as an editor uses it. One file is sent through
llama.cpp's `/infill` (an extra chunk of another file, the prefix, lines of suffix), then
`--followups` more requests, each after a one-line edit just above the cursor, as an editor sends
at every pause: the time to the first token (streamed) and to the whole completion, and the
prompt tokens the server read again (`timings.prompt_n`) and reused from its cache (`timings.cache_n`).

With `--prompts N`, N more requests cut from Python sources (greedy, `--n-predict` tokens) whose
completions are compared between servers. `--compare-llama-server` runs the same requests against
llama.cpp's llama-server on the same GGUF, after localbatch (each server alone, one after the
other). Without `--url`, `localbatch serve` is started with this command's engine options."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.bench.datasets import FollowUps, fim_cut_points
from app.bench.server import running
from app.bench.stats import median, percentile
from app.engine.types.errors import LocalbatchError


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    cmd: list[str] | None = None  # started (and stopped) around its requests; None: already running


def infill(client, url: str, body: dict, n_predict: int, stream: bool) -> dict:  # noqa: ANN001 - an httpx.Client
    """One /infill; with `stream`, the time to the first content and the last event's fields."""
    import httpx

    body = {"n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": True, "stream": stream, **body}
    start = time.perf_counter()
    try:
        if not stream:
            r = client.post(f"{url}/infill", json=body)
            r.raise_for_status()
            return {**r.json(), "latency_s": time.perf_counter() - start}
        first, content, last = None, "", {}
        with client.stream("POST", f"{url}/infill", json=body) as r:
            if r.status_code != 200:
                r.read()
                r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("content") and first is None:
                    first = time.perf_counter() - start
                content += event.get("content", "")
                last = event
    except httpx.HTTPStatusError as e:
        raise LocalbatchError(f"{url}/infill answered {e.response.status_code}: {e.response.text[:300]}") from None
    except httpx.TransportError as e:
        raise LocalbatchError(f"{url}/infill: {e or type(e).__name__}") from None
    return {**last, "content": content, "ttft_s": first, "latency_s": time.perf_counter() - start}


def measure(name: str, url: str, cuts: list[tuple[str, str]], follow: list[dict], n_predict: int) -> dict:
    """The follow-ups (streamed) and the cut points' completions against one server."""
    import httpx

    # A new connection a request, as llama.vim's curl jobs make (llama-server closes a kept-alive
    # connection after a few requests, and a request sent on it as it closes is lost).
    with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        contents = [infill(client, url, {"input_prefix": p, "input_suffix": s}, n_predict, stream=False)["content"]
                    for p, s in cuts]
        runs = [infill(client, url, body, n_predict, stream=True) for body in follow]
    later = runs[1:]  # the first request reads the whole file
    ttfts = [r["ttft_s"] for r in later if r["ttft_s"] is not None]
    return {"server": name, "contents": contents, "first_ttft_s": _round(runs[0]["ttft_s"]),
            "first_latency_s": _round(runs[0]["latency_s"]),
            "followup_ttft_p50_s": _round(median(ttfts)), "followup_ttft_p90_s": _round(percentile(ttfts, 0.9)),
            "followup_latency_p50_s": _round(median(r["latency_s"] for r in later)),
            "prompt_n": [(r.get("timings") or {}).get("prompt_n") for r in runs],
            "cache_n": [(r.get("timings") or {}).get("cache_n") for r in runs],
            "tokens_cached": [r.get("tokens_cached") for r in runs]}


def _round(x: float | None) -> float | None:
    return None if x is None or x != x else round(x, 4)  # x != x: NaN, no figure


def llama_server_cmd(binary: str, gguf: str, port: int) -> list[str]:
    return [binary, "-m", gguf, "-t", str(os.cpu_count() or 2), "-c", "8192", "--port", str(port), "-np", "1"]


def run_complete(targets: list[Target], followups: FollowUps, count: int, prompts: int, n_predict: int,
                 log: Callable[[str], None] = print) -> dict:
    cuts, follow = fim_cut_points(prompts) if prompts else [], followups.requests(max(count, 1))
    servers = []
    for t in targets:
        if t.cmd is None:
            servers.append(measure(t.name, t.url, cuts, follow, n_predict))
        else:
            with running(t.cmd, t.url):
                servers.append(measure(t.name, t.url, cuts, follow, n_predict))
        log(json.dumps({k: v for k, v in servers[-1].items() if k != "contents"}))
    report: dict = {"file": str(followups.file), "followups": len(follow) - 1, "prompts": prompts,
                    "n_predict": n_predict, "servers": [{k: v for k, v in s.items() if k != "contents"} for s in servers]}
    if len(servers) == 2:
        ours, theirs = servers[0]["contents"], servers[1]["contents"]
        report["greedy_equal"] = sum(a == b for a, b in zip(ours, theirs))
        report["differences"] = [{"cut": i, servers[0]["server"]: a, servers[1]["server"]: b}
                                 for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        a, b = servers[0]["followup_ttft_p50_s"], servers[1]["followup_ttft_p50_s"]
        report["followup_ttft_ratio"] = round(a / b, 3) if a and b else None
    return report


def format_report(r: dict) -> str:
    lines = [f"{r['followups']} follow-ups of {Path(r['file']).name}, {r['n_predict']} tokens each"]
    for s in r["servers"]:
        cached = [c for c in s["cache_n"][1:] if c is not None]
        read = [n for n in s["prompt_n"][1:] if n is not None]
        lines.append(f"{s['server']:<13} first request TTFT {_ms(s['first_ttft_s'])}; follow-ups TTFT p50 "
                     f"{_ms(s['followup_ttft_p50_s'])}, p90 {_ms(s['followup_ttft_p90_s'])}, completion p50 "
                     f"{_ms(s['followup_latency_p50_s'])}"
                     + (f"; prompt tokens read again {min(read)}-{max(read)}" if read else "")
                     + (f", reused {min(cached)}-{max(cached)}" if cached else ""))
    if "greedy_equal" in r:
        lines.append(f"greedy completions equal: {r['greedy_equal']}/{r['prompts']}")
        lines += [f"  #{d['cut']}: " + " / ".join(f"{k} {v!r}" for k, v in d.items() if k != "cut")
                  for d in r["differences"]]
    if r.get("followup_ttft_ratio"):
        lines.append(f"follow-up TTFT ratio {r['servers'][0]['server']} / {r['servers'][1]['server']}: "
                     f"{r['followup_ttft_ratio']:.2f}")
    return "\n".join(lines)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s" if s >= 10 else f"{s * 1e3:.0f} ms"
