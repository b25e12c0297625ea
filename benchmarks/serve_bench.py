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


class _Recorder(asyncio.Protocol):
    """Keeps each piece of the response with its arrival time and nothing more: the client shares
    the machine with the server, and parsing SSE as it streams (httpx: ~8% of a core at one
    100 tok/s stream on a 2-core VM; asyncio streams: ~4%) took time from the server's engine,
    about twice over (both of its threads wait for the one that lost its core). The pieces are
    parsed once the response has ended."""

    def __init__(self, done: asyncio.Future) -> None:
        self.pieces: list[tuple[float, bytes]] = []
        self.done = done

    def data_received(self, data: bytes) -> None:
        self.pieces.append((time.perf_counter(), data))
        if data.endswith(b"\r\n0\r\n\r\n") or data == b"0\r\n\r\n":  # the last chunk
            self.connection_lost(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def one(host: str, port: int, prompt: list[int], max_tokens: int, ttfts: list[float],
              itls: list[float]) -> int:
    """One streamed request on its own connection; TTFT and the gaps between SSE events that carry
    text are taken from the arrival times of the pieces that completed them."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, recorder = await loop.create_connection(lambda: _Recorder(done), host, port)
    start = time.perf_counter()
    try:
        transport.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        await done
    finally:
        transport.close()
    times = [t for t, _ in _text_events(recorder.pieces, f"{host}:{port}")]
    if times:
        ttfts.append(times[0] - start)
        itls.extend(b - a for a, b in zip(times, times[1:]))
    return max_tokens


def _text_events(pieces: list[tuple[float, bytes]], server: str) -> list[tuple[float, dict]]:
    """(arrival time, event) of each SSE event with text, from a chunked HTTP response's pieces."""
    raw, ends, length = b"".join(data for _, data in pieces), [], 0
    for t, data in pieces:
        length += len(data)
        ends.append((length, t))
    head, sep, rest = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if not sep or b" 200 " not in status:
        raise RuntimeError(f"{server} answered {status.decode(errors='replace').strip() or 'nothing'}")
    offset = len(head) + len(sep)  # both servers stream with chunked transfer encoding
    out, pending, pos, piece = [], b"", 0, 0
    while True:
        line_end = rest.index(b"\r\n", pos)
        size = int(rest[pos:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return out
        pos = line_end + 2 + size + 2
        while ends[piece][0] < offset + pos - 2:  # the piece that brought this chunk's last byte
            piece += 1
        pending += rest[line_end + 2:line_end + 2 + size]
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                obj = json.loads(event[6:])
                if obj["choices"] and obj["choices"][0].get("text"):
                    out.append((ends[piece][1], obj))


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
