"""N concurrent streaming chat requests to an OpenAI-compatible server, with no app: the baseline
for the app's `--backend-url` mode.

    python benchmarks/stream_clients.py --url http://127.0.0.1:8088/v1 --n 4 --max-tokens 300

Prints each stream's tokens (content chunks) and tok/s from its first to its last token, and their sum."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

PROMPT = "Write a very long story about a lighthouse keeper who collects clocks, chapter by chapter."


async def one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, float]:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": PROMPT}]}
    times = []
    async with client.stream("POST", f"{url}/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                times.append(time.monotonic())
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return len(times), rate


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=300)
    args = p.parse_args()
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(one(client, args.url, args.max_tokens) for _ in range(args.n)))
    for tokens, rate in results:
        print(f"{tokens} tok at {rate:.1f} tok/s")
    print(f"sum {sum(r for _, r in results):.1f} tok/s over {args.n} streams")


if __name__ == "__main__":
    asyncio.run(main())
