"""Code completion under load: do 4 editors' completion streams and 2 streaming chats all keep going
on one engine, how long does a completion take, and is anything answered 5xx or left holding KV?

    localbatch bench research fim_editors --model qwen2.5-coder-1.5b-instruct [--editors 4] [--chats 2]
        [--requests 8] [--pause 4] [--url http://127.0.0.1:8000] [-- SERVE FLAGS]
    # --url: an already running endpoint; after --: flags for `localbatch serve`
    #   (e.g. -- --long-prefill-token-threshold 0 for first come, first served)

Each editor edits its own file of this repository (an extra chunk, ~120 lines of prefix, 40 of
suffix): it opens the file (one completion, waited for), then types one line just above the cursor, then pauses `--pause` seconds; at each pause it
sends a streaming `/infill` (greedy, `n_predict` 32) and, as llama.vim does, cancels the one still
running. Each chat streams `/v1/chat/completions` replies of `--chat-tokens` tokens, one after
another, until every editor is done. Reports completion TTFT and latency p50/p90 (requests that
finished), how many were cancelled, the longest silence of each chat stream, every non-200 status,
and the KV blocks held once all clients are gone (must be 0)."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from app.bench.server import free_port, localbatch_serve_cmd, running
from app.bench.stats import median, percentile

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its files are the editors' files
FILES = ["app/ui/chat.py", "app/engine/core/scheduler.py", "app/server/infill.py", "app/engine/core/block_manager.py"]
QUESTION = "Write a Python function that parses an ISO 8601 date without a library, with tests."


def editor_file(index: int) -> tuple[dict, str, str]:
    """(extra chunk, prefix, suffix) of editor `index`: a cursor in the middle of one of app/'s files."""
    lines = (ROOT / FILES[index % len(FILES)]).read_text().splitlines(keepends=True)
    extra_path = FILES[(index + 1) % len(FILES)]
    extra = {"filename": extra_path, "text": "".join((ROOT / extra_path).read_text().splitlines(True)[:60])}
    cursor = min(len(lines) - 40, 160)
    return extra, "".join(lines[max(0, cursor - 120):cursor]), "".join(lines[cursor:cursor + 40])


async def infill(client: httpx.AsyncClient, url: str, body: dict, out: dict) -> None:
    """One streamed /infill; fills `out` as it goes so a cancelled request keeps what it saw."""
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/infill", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content") and "ttft_s" not in out:
                out["ttft_s"] = time.perf_counter() - start
            if event.get("stop"):
                out["cache_n"] = event.get("timings", {}).get("cache_n")
                out["prompt_n"] = event.get("timings", {}).get("prompt_n")
    out["latency_s"] = time.perf_counter() - start


async def editor(index: int, url: str, args: argparse.Namespace) -> list[dict]:
    extra, prefix, suffix = editor_file(index)
    first: dict = {"editor": index, "request": "open"}
    done: list[dict] = [first]
    async with httpx.AsyncClient(timeout=None) as client:
        await infill(client, url, {"input_extra": [extra], "input_prefix": prefix + "        ", "input_suffix": suffix,
                                   "n_predict": args.n_predict, "temperature": 0.0, "top_k": 1, "stream": True}, first)
        task, out = None, None
        for k in range(1, args.requests + 1):
            if task is not None and not task.done():
                task.cancel()  # the user typed again: the editor drops the old completion
                out["cancelled"] = True
            typed = "".join(f"        # edit {j} by editor {index}\n" for j in range(k))
            body = {"input_extra": [extra], "input_prefix": prefix + typed + "        ", "input_suffix": suffix,
                    "n_predict": args.n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": True,
                    "stream": True}
            out = {"editor": index, "request": k}
            done.append(out)
            task = asyncio.create_task(infill(client, url, body, out))
            await asyncio.sleep(args.pause)
        if task is not None:
            try:
                await task  # the last one runs to its end
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                out["error"] = repr(exc)
    return done


async def chat(index: int, url: str, args: argparse.Namespace, stop: asyncio.Event) -> dict:
    gaps, ttfts, tokens, statuses, replies = [], [], 0, [], 0
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "stream": True, "max_tokens": args.chat_tokens, "temperature": 0.7, "seed": index,
            "messages": [{"role": "user", "content": QUESTION}]}
    async with httpx.AsyncClient(timeout=None) as client:
        while not stop.is_set():
            last, seen = time.perf_counter(), False
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    await r.aread()
                    break  # reported in statuses; a chat that is refused does not retry in a loop
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        (gaps if seen else ttfts).append(now - last)
                        last, tokens, seen = now, tokens + 1, True
            replies += 1
    return {"chat": index, "replies": replies, "chunks": tokens, "ttft_p50_s": median(ttfts),
            "ttft_max_s": max(ttfts, default=None),
            "max_gap_s": max(gaps, default=None), "gap_p50_s": median(gaps), "statuses": sorted(set(statuses))}


async def scenario(url: str, args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    chats = [asyncio.create_task(chat(i, url, args, stop)) for i in range(args.chats)]
    editors = await asyncio.gather(*(editor(i, url, args) for i in range(args.editors)))
    stop.set()
    chat_rows = await asyncio.gather(*chats)
    opens = [rows[0] for rows in editors]
    reqs = [r for rows in editors for r in rows[1:]]
    finished = [r for r in reqs if "latency_s" in r and not r.get("cancelled")]
    await asyncio.sleep(1.0)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    usage = next((float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("localbatch:kv_cache_usage_perc")), None)
    return {
        "open_latency_s": [round(r.get("latency_s", float("nan")), 2) for r in opens],
        "open_statuses": sorted({r.get("status") for r in opens}, key=str),
        "completions": len(reqs), "finished": len(finished), "cancelled": sum(bool(r.get("cancelled")) for r in reqs),
        "errors": [r for r in reqs if "error" in r][:5], "statuses": sorted({r.get("status") for r in reqs}, key=str),
        "ttft_p50_s": percentile([r["ttft_s"] for r in finished if "ttft_s" in r], 0.5),
        "latency_p50_s": percentile([r["latency_s"] for r in finished], 0.5),
        "latency_p90_s": percentile([r["latency_s"] for r in finished], 0.9),
        "prompt_n": [r.get("prompt_n") for r in finished], "cache_n": [r.get("cache_n") for r in finished], "chats": chat_rows, "kv_usage_after": usage,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--url", help="an endpoint already running (e.g. the app's embedded one); else serve starts")
    p.add_argument("--editors", type=int, default=4)
    p.add_argument("--chats", type=int, default=2)
    p.add_argument("--requests", type=int, default=8, help="completion requests per editor")
    p.add_argument("--pause", type=float, default=4.0, help="seconds between an editor's requests")
    p.add_argument("--n-predict", type=int, default=32)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("serve_args", nargs="*", help="after --: flags for localbatch serve")


def run(args: argparse.Namespace) -> dict:
    if args.url:
        result = asyncio.run(scenario(args.url, args))
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with running(localbatch_serve_cmd(["--model", args.model, *args.serve_args], port), url, timeout=600):
            result = asyncio.run(scenario(url, args))
    print(json.dumps(result, indent=1))
    return result
