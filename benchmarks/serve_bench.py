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
import urllib.parse


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(host: str, port: int, prompt: list[int], max_tokens: int, ttfts: list[float],
              itls: list[float]) -> int:
    """One streamed request on its own connection, read with asyncio's streams: the client shares
    the machine with the server, and httpx's streaming took ~8% of a core at one 100 tok/s stream on
    a 2-core VM, which the server's engine then lacked (about twice that: both of its threads wait
    for the one that lost its core)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    start = time.perf_counter()
    last = None
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{host}:{port} answered {status.decode(errors='replace').strip()}")
        while (await reader.readline()).strip():
            pass  # headers: both servers stream with chunked transfer encoding
        pending = b""
        while size := int((await reader.readline()).split(b";")[0] or b"0", 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {") or not json.loads(event[6:])["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - start)
                else:
                    itls.append(now - last)
                last = now
    finally:
        writer.close()
    return max_tokens


async def level(url: str, concurrency: int, rounds: int, prompt_len: int, max_tokens: int, max_id: int,
                seed: int) -> dict:
    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []
    address = urllib.parse.urlsplit(url)

    async def client_loop() -> int:
        total = 0
        for _ in range(rounds):
            prompt = [rng.randrange(max_id // 2, max_id) for _ in range(prompt_len)]
            total += await one(address.hostname, address.port or 80, prompt, max_tokens, ttfts, itls)
        return total

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client_loop() for _ in range(concurrency))))
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
