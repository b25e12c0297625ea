"""Streaming benchmark of an OpenAI-compatible /v1/completions endpoint (localbatch or llama-server).

For each concurrency C, C clients each stream R requests one after another; prints aggregate output
tok/s, TTFT p50/p99 and inter-token latency p50/p99 (client side, per SSE chunk that carries text).

    python serve_bench.py --url http://127.0.0.1:8000 --concurrency 1,4,8,16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, ttfts: list[float],
              itls: list[float]) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    start = time.perf_counter()
    last = None
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not json.loads(line[6:])["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                itls.append(now - last)
            last, chunks = now, chunks + 1
    return max_tokens


async def level(url: str, concurrency: int, rounds: int, prompt_len: int, max_tokens: int, max_id: int,
                seed: int) -> dict:
    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []

    async def client_loop(c: httpx.AsyncClient) -> int:
        total = 0
        for _ in range(rounds):
            prompt = [rng.randrange(max_id // 2, max_id) for _ in range(prompt_len)]
            total += await one(c, prompt, max_tokens, ttfts, itls)
        return total

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client_loop(c) for _ in range(concurrency))))
        elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "output_tok_s": tokens / elapsed, "requests": concurrency * rounds,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
            "itl_p50_ms": 1e3 * statistics.median(itls), "itl_p99_ms": 1e3 * pct(itls, 0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-token-id", type=int, default=30000, help="prompt ids are drawn below this")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        r = asyncio.run(level(args.url, c, args.rounds, args.prompt_len, args.max_tokens,
                              args.max_token_id, seed=c))
        results.append(r)
        if not args.json:
            print(f"{c:3d} clients: {r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms "
                  f"p99 {r['ttft_p99_ms']:7.1f} ms  ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms",
                  flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
