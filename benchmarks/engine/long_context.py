"""How much slower is decoding after a long prompt than after a short one? One sequence, greedy:
a random-token prompt of each length, then `--tokens` decode steps; the decode step time is the
median of the last steps (the prompt's steps and the first token excluded).

    localbatch bench research long_context --model qwen2.5-coder-1.5b-instruct --context 128,4096
    localbatch bench research long_context --kv-cache-dtype int8   # the same over an int8 cache

Run it from two trees back to back (`PYTHONPATH=<other tree>`) to compare kernels; docs/benchmarks.md
("Decode after a long prompt") gives the figures and the bandwidth bound.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams


def decode_after(engine: LLMEngine, prompt_len: int, tokens: int, rng: random.Random) -> tuple[float, float]:
    """(seconds to the first token, median decode step seconds) after a prompt of `prompt_len` tokens."""
    prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    decode = steps[-(tokens - 8):]  # the first decode steps still warm the new blocks
    return sum(steps[:-(tokens - 1)]), statistics.median(decode)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", default="64,3500", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="tokens decoded after each prompt")
    parser.add_argument("--label", default="", help="printed before each line (e.g. the tree's name)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's storage (auto, float16, int8, ...)")


def run(args: argparse.Namespace) -> dict:
    engine = LLMEngine(args.model, kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(0)
    base = None
    rows = []
    for n in (int(x) for x in args.context.split(",")):
        ttft, step = decode_after(engine, n, args.tokens, rng)
        base = base or 1 / step
        print(f"{args.label} context {n}: first token {ttft:.2f} s, decode {1 / step:.1f} tok/s "
              f"({step * 1e3:.1f} ms a step; {1 / step / base:.2f}x the first length's rate)", flush=True)
        rows.append({"context": n, "ttft_s": round(ttft, 3), "step_ms": round(step * 1e3, 2),
                     "decode_tok_s": round(1 / step, 1), "of_first": round(1 / step / base, 3)})
    return {"model": engine.plan.model_name, "rows": rows}
