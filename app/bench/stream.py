"""A streaming client that costs the server as little as it can: C clients on raw sockets, each
streaming requests one after another to `/v1/completions` (token-id prompts) or
`/v1/chat/completions` (one user message), timing each SSE event that carries text.

The client shares the machine with the server. Parsing SSE as it streams (httpx, or asyncio
streams) took a share of a core from the server's engine, and cost the engine more than that
(both of its threads wait for the one that lost its core; docs/tuning.md). So each piece of a
response is kept with its arrival time and nothing more, and parsed once the response has ended."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from dataclasses import dataclass

from app.bench.datasets import CHAT_PROMPT, random_prompt
from app.bench.stats import median, percentile


@dataclass(frozen=True)
class Load:
    """What each client sends: `endpoint` "completions" (`prompt_len` random token ids below
    `max_token_id`) or "chat" (`chat_prompt` as one user message); `max_tokens` each, EOS ignored."""

    endpoint: str = "completions"
    prompt_len: int = 128
    max_tokens: int = 64
    max_token_id: int = 30000
    chat_prompt: str = CHAT_PROMPT

    def body(self, rng: random.Random) -> tuple[str, bytes]:
        common = {"max_tokens": self.max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        if self.endpoint == "chat":
            body = {"messages": [{"role": "user", "content": self.chat_prompt}], **common}
            return "/v1/chat/completions", json.dumps(body).encode()
        body = {"prompt": random_prompt(rng, self.prompt_len, self.max_token_id), **common}
        return "/v1/completions", json.dumps(body).encode()


class _Recorder(asyncio.Protocol):
    """Keeps each piece of the response with its arrival time."""

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


async def one(host: str, port: int, path: str, body: bytes) -> list[float]:
    """One streamed request on its own connection; the arrival times of its text events, from its start."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, recorder = await loop.create_connection(lambda: _Recorder(done), host, port)
    start = time.perf_counter()
    try:
        transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                        % (path.encode(), host.encode(), len(body), body))
        await done
    finally:
        transport.close()
    return [t - start for t in text_event_times(recorder.pieces, f"{host}:{port}")]


def _has_text(event: dict) -> bool:
    choice = (event.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def text_event_times(pieces: list[tuple[float, bytes]], server: str) -> list[float]:
    """Arrival time of each SSE event with text (completions' `text`, chat's `delta.content`), from
    a chunked HTTP response's pieces."""
    raw, ends, length = b"".join(data for _, data in pieces), [], 0
    for t, data in pieces:
        length += len(data)
        ends.append((length, t))
    head, sep, rest = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if not sep or b" 200 " not in status:
        raise RuntimeError(f"{server} answered {status.decode(errors='replace').strip() or 'nothing'}")
    offset = len(head) + len(sep)  # localbatch and llama-server stream with chunked transfer encoding
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
            if event.startswith(b"data: {") and _has_text(json.loads(event[6:])):
                out.append(ends[piece][1])


async def level(url: str, clients: int, rounds: int, load: Load, seed: int) -> dict:
    """`clients` clients, each streaming `rounds` requests one after another: output tok/s over the
    level (max_tokens a request: EOS is ignored), TTFT and inter-token latency percentiles."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []
    address = urllib.parse.urlsplit(url)

    async def client_loop() -> None:
        for _ in range(rounds):
            path, body = load.body(rng)
            times = await one(address.hostname or "127.0.0.1", address.port or 80, path, body)
            if times:
                ttfts.append(times[0])
                itls.extend(b - a for a, b in zip(times, times[1:]))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    return {"concurrency": clients, "requests": clients * rounds,
            "output_tok_s": round(clients * rounds * load.max_tokens / elapsed, 2),
            "ttft_p50_ms": round(1e3 * median(ttfts), 2), "ttft_p99_ms": round(1e3 * percentile(ttfts, 0.99), 2),
            "itl_p50_ms": round(1e3 * median(itls), 2), "itl_p99_ms": round(1e3 * percentile(itls, 0.99), 2)}


def run_level(url: str, clients: int, rounds: int, load: Load, seed: int) -> dict:
    return asyncio.run(level(url, clients, rounds, load, seed))
