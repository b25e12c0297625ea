"""Soak `localbatch serve` under a mixed load with faults, and check that nothing is lost.

    localbatch bench research soak --model smollm2-135m-instruct --duration 1800 --clients 32 [--json FILE]
        [--max-requests N] [-- extra serve flags, e.g. --kv-cache-bytes 268435456]

Starts the server on a free loopback port (nothing else is ever contacted) and runs `--clients`
concurrent clients until `--duration` seconds or `--max-requests` requests have passed. Each
request is drawn from a mix: chat and completions, streamed and not, `n=2`, `json_schema`, a forced
tool call, stop strings, a prompt near the context limit, a client that disconnects mid-stream
(~10%), and malformed bodies (~5%: bad JSON, wrong types, huge `max_tokens`, negative `n`, invalid
UTF-8, a body over the size limit; unknown fields are ignored by design and must succeed).

Every 5 s it samples the server's RSS, open file descriptors and threads (/proc) and the tokens
the clients received. At the end it waits for the server to go idle and reads `/metrics`.
Report: requests by outcome and status, 5xx count, malformed bodies answered 4xx with an OpenAI
error object, tokens/s over time, RSS / fds / threads over time (and RSS growth after the first
`--warmup` seconds), KV blocks in use and running requests after the run, TTFT and ITL
percentiles. The record holds the samples too. Exit status 1 when a check fails: any 5xx, a malformed body not answered 4xx with an
error object, KV blocks or running requests left over, fds or threads growing."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.bench.server import fetch_counters, free_port, localbatch_serve_cmd, start_server, stop_server
from app.bench.stats import percentile

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@dataclass
class Stats:
    outcomes: Counter = field(default_factory=Counter)  # kind -> count of "ok", "4xx", "5xx", ...
    statuses: Counter = field(default_factory=Counter)
    malformed: int = 0
    malformed_ok: int = 0  # answered 4xx with an OpenAI error object
    malformed_bad: list[str] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0  # streamed content pieces plus non-streamed completion tokens
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def normal_request(kind: str, rng: random.Random, context: int) -> tuple[str, dict]:
    chat = {"messages": [{"role": "user", "content": f"Tell me about {words(6, rng)}."}], "max_tokens": 48,
            "temperature": 0.8}
    text = {"prompt": f"Once upon a time {words(8, rng)}", "max_tokens": 48, "temperature": 0.8}
    if kind == "chat":
        return "/v1/chat/completions", chat
    if kind == "completion":
        return "/v1/completions", text
    if kind == "n2":
        return "/v1/chat/completions", {**chat, "n": 2}
    if kind == "json_schema":
        return "/v1/chat/completions", {**chat, "max_tokens": 96, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    if kind == "tool":
        return "/v1/chat/completions", {**chat, "tools": [WEATHER], "max_tokens": 64,
                                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if kind == "stop":
        return "/v1/completions", {**text, "stop": [" the", "\n"]}
    if kind == "long":  # about 3/4 of the context in words (a word is 1-2 tokens)
        return "/v1/completions", {"prompt": words(max(context * 3 // 8, 16), rng), "max_tokens": 16}
    raise ValueError(kind)


def malformed_cases() -> list[tuple[str, bytes, str, bool]]:
    """(path, body, what it is, whether 200 is the right answer) for each kind of bad body."""
    return [
        ("/v1/chat/completions", b'{"messages": [', "bad JSON", False),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), "wrong type", False),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(), "huge max_tokens", False),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": -1}).encode(),
         "negative n", False),
        ("/v1/completions", b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 4}', "invalid UTF-8", False),
        ("/v1/completions", b'{"prompt": "' + b"a" * (33 << 20) + b'"}', "oversized body", False),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4, "frobnicate": 1}).encode(),
         "unknown field (ignored)", True),
    ]


def is_error_object(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type"} <= error.keys()


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Stats, context: int) -> None:
    roll = rng.random()
    if roll < 0.05:
        await send_malformed(client, rng.choice(malformed_cases()), stats)
        return
    stats.requests += 1
    kind = rng.choices(["chat", "completion", "n2", "json_schema", "tool", "stop", "long"], [3, 3, 2, 2, 2, 2, 1])[0]
    await send_normal(client, kind, rng, roll, stats, context)


async def send_malformed(client: httpx.AsyncClient, case: tuple[str, bytes, str, bool], stats: Stats) -> None:
    path, body, what, ok_200 = case
    stats.requests += 1
    stats.malformed += 1
    try:
        r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    except httpx.HTTPError as e:  # the server may close on an oversized body: not a 5xx
        stats.outcomes[f"malformed:{type(e).__name__}"] += 1
        stats.malformed_ok += what == "oversized body"
        if what != "oversized body":
            stats.malformed_bad.append(f"{what}: {e!r}"[:120])
        return
    stats.statuses[r.status_code] += 1
    good = (r.status_code == 200) if ok_200 else (400 <= r.status_code < 500 and is_error_object(r))
    stats.malformed_ok += good
    if not good and len(stats.malformed_bad) < 10:
        stats.malformed_bad.append(f"{what}: {r.status_code} {r.text[:80]!r}")
    stats.outcomes["malformed"] += 1


async def send_normal(client: httpx.AsyncClient, kind: str, rng: random.Random, roll: float, stats: Stats,
                      context: int) -> None:
    path, body = normal_request(kind, rng, context)
    stream = rng.random() < 0.6 and kind != "long"
    disconnect = stream and roll < 0.15  # ~10% of all requests
    start = time.perf_counter()
    try:
        if stream:
            body = {**body, "stream": True}
            async with client.stream("POST", path, json=body) as r:
                stats.statuses[r.status_code] += 1
                if r.status_code != 200:
                    stats.outcomes[f"{kind}:{r.status_code}"] += 1
                    return
                last, chunks = None, 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft.append(now - start)
                    else:
                        stats.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    stats.tokens += 1
                    if disconnect and chunks >= 3:
                        stats.outcomes["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
            stats.outcomes[f"{kind}:ok"] += 1
        else:
            r = await client.post(path, json=body)
            stats.statuses[r.status_code] += 1
            if r.status_code == 200:
                stats.tokens += r.json().get("usage", {}).get("completion_tokens", 0)
                stats.ttft.append(time.perf_counter() - start)
            stats.outcomes[f"{kind}:{'ok' if r.status_code == 200 else r.status_code}"] += 1
    except httpx.HTTPError as e:
        stats.outcomes[f"{kind}:{type(e).__name__}"] += 1
        if len(stats.errors) < 10:
            stats.errors.append(f"{kind}: {e!r}"[:160])


def proc_sample(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def soak(base: str, pid: int, args: argparse.Namespace) -> dict:
    stats, samples = Stats(), []
    context = int(httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0].get("max_model_len", 2048))
    context = min(context, 2048)  # "near the context limit" within a budget a 2-core soak can afford
    deadline = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.clients * 2)

    async def client_loop(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
            while time.monotonic() < deadline and stats.requests < args.max_requests:
                await one_request(client, rng, stats, context)

    async def monitor() -> None:
        start, last_tokens = time.monotonic(), 0
        while time.monotonic() < deadline and stats.requests < args.max_requests:
            await asyncio.sleep(5)
            sample = {"t": round(time.monotonic() - start), **proc_sample(pid),
                      "tok_s": round((stats.tokens - last_tokens) / 5, 1), "requests": stats.requests}
            last_tokens = stats.tokens
            samples.append(sample)
            print(json.dumps(sample), flush=True)

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(60, connect=10)) as client:
        for case in malformed_cases():  # each kind of bad body at least once
            await send_malformed(client, case, stats)
    await asyncio.gather(monitor(), *(client_loop(i) for i in range(args.clients)))
    for _ in range(60):  # the server finishes what was cut off, then it must be idle
        m = fetch_counters(base)
        if m.get("running", 1) == 0 and m.get("waiting", 1) == 0:
            break
        await asyncio.sleep(1)
    m = fetch_counters(base)
    end = proc_sample(pid)
    after_warmup = [s for s in samples if s["t"] >= args.warmup] or samples[-1:] or [end]
    blocks_used = round(m.get("kv_usage", 0) * m.get("blocks_total", 0))

    def pct(values: list[float], q: float) -> float | None:
        return round(percentile(values, q / 100) * 1000, 1) if values else None

    report = {
        "requests": stats.requests, "outcomes": dict(sorted(stats.outcomes.items())),
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "5xx": sum(v for k, v in stats.statuses.items() if k >= 500),
        "malformed": stats.malformed, "malformed_answered_4xx_with_error": stats.malformed_ok,
        "malformed_wrong": stats.malformed_bad, "client_errors": stats.errors,
        "kv_blocks_in_use_after": blocks_used, "running_after": m.get("running"),
        "waiting_after": m.get("waiting"),
        "rss_mb": {"first_after_warmup": after_warmup[0]["rss_mb"], "end": end["rss_mb"],
                   "growth_after_warmup_pct": round(100 * (end["rss_mb"] / after_warmup[0]["rss_mb"] - 1), 1)},
        "fds": {"first": samples[0]["fds"] if samples else end["fds"], "end": end["fds"]},
        "threads": {"first": samples[0]["threads"] if samples else end["threads"], "end": end["threads"]},
        "ttft_ms": {"p50": pct(stats.ttft, 50), "p99": pct(stats.ttft, 99)},
        "itl_ms": {"p50": pct(stats.itl, 50), "p99": pct(stats.itl, 99)},
        "samples": samples,
    }
    report["ok"] = (report["5xx"] == 0 and not stats.malformed_bad and blocks_used == 0
                    and report["running_after"] == 0 and report["fds"]["end"] <= report["fds"]["first"] + 4
                    and report["threads"]["end"] <= report["threads"]["first"] + 2)
    return report


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--warmup", type=float, default=300.0, help="RSS growth is measured from this many seconds on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="extra `localbatch serve` flags (after --)")


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(localbatch_serve_cmd(["--model", args.model, *args.serve_args], port), base, timeout=300,
                          quiet=False)
    try:
        report = asyncio.run(soak(base, server.pid, args))
    finally:
        stop_server(server, timeout=60)
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    return report
