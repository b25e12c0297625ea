"""Time to first token of a long chat prompt read cold, and again after a restart with the KV disk
tier on (a new engine over the same directory): the same prompt, whose greedy tokens must be the
same; then a new question after the same file, its prefix in memory, for comparison.

    localbatch bench research kv_disk_tier [--model qwen2.5-coder-1.5b-instruct]
                                           [--kv-cache-dtype auto,int8] [--file PATH] [--tokens 16]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def chat(engine: LLMEngine, source: str, question: str, max_tokens: int) -> tuple[float, list[int], int, int]:
    """(TTFT s, tokens, prompt tokens, of them from disk) of one chat request run alone."""
    prompt = [{"role": "user", "content": f"{source}\n\n{question}"}]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seq = engine.add_request(prompt, params)
    ttft = None
    while engine.has_unfinished():
        engine.step()
        if ttft is None and seq.num_output_tokens:
            ttft = time.perf_counter() - start
    return ttft, seq.output_token_ids, seq.num_prompt_tokens, seq.num_disk_cached_tokens


def time_restores(engine: LLMEngine) -> list[float]:
    """Record how long each `restore_prefix` call of `engine` takes (the disk reads in a step)."""
    times: list[float] = []
    restore = engine.block_manager.restore_prefix

    def timed(seq):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        restore(seq)
        times.append(time.perf_counter() - t)

    engine.block_manager.restore_prefix = timed
    return times


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--kv-cache-dtype", default="auto,int8")
    ap.add_argument("--file", default="app/engine/core/scheduler.py", help="the attached file")
    ap.add_argument("--tokens", type=int, default=16)


def run(args: argparse.Namespace) -> dict:
    source = Path(args.file).read_text()
    rows = [restart_row(args, source, kv) for kv in args.kv_cache_dtype.split(",")]
    return {"model": args.model, "rows": rows, "ok": all(r["tokens_identical"] for r in rows)}


def restart_row(args: argparse.Namespace, source: str, kv: str) -> dict:
    """One KV dtype: cold, then the same prompt after a restart, then a new question."""
    with tempfile.TemporaryDirectory() as d:
        settings = dict(model=args.model, kv_cache_dtype=kv, kv_disk_cache_dir=d, kv_disk_cache_bytes=4 << 30)
        first = LLMEngine(**settings)
        cold, cold_tokens, n, _ = chat(first, source, "What does this module do?", args.tokens)
        t = time.perf_counter()
        first.block_manager.disk.flush()
        flush_s = time.perf_counter() - t
        written = first.stats().kv_disk
        del first
        gc.collect()
        second = LLMEngine(**settings)
        restores = time_restores(second)
        warm, warm_tokens, _, from_disk = chat(second, source, "What does this module do?", args.tokens)
        read = second.stats().kv_disk
        new_q, _, n2, _ = chat(second, source, "Which function admits waiting requests?", args.tokens)
        print(f"{args.model} kv={kv}: {n} prompt tokens; cold TTFT {cold:.2f} s; "
              f"wrote {written.num_blocks_written} blocks, {written.bytes_written / 1e6:.1f} MB "
              f"(queue drained {flush_s:.2f} s after the reply); after a restart: same prompt TTFT "
              f"{warm:.2f} s ({from_disk} tok from disk, {read.bytes_read / 1e6:.1f} MB read in "
              f"{max(restores):.2f} s within the admitting step), tokens identical: "
              f"{warm_tokens == cold_tokens}; then a new question ({n2} tok) over the prefix in memory: "
              f"TTFT {new_q:.2f} s", flush=True)
        del second
        gc.collect()
    return {"kv_cache_dtype": kv, "prompt_tokens": n, "cold_ttft_s": round(cold, 3),
            "restart_ttft_s": round(warm, 3), "from_disk_tokens": from_disk, "mb_written": round(written.bytes_written / 1e6, 1),
            "mb_read": round(read.bytes_read / 1e6, 1), "read_s": round(max(restores), 3),
            "tokens_identical": warm_tokens == cold_tokens, "new_question_ttft_s": round(new_q, 3)}
