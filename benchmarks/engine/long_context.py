"""How much slower is decoding after a long prompt than after a short one? One sequence, greedy:
a random-token prompt of each length, then `--tokens` decode steps; the decode step time is the
median of the last steps (the prompt's steps and the first token excluded).

Each length's floor: what a step reads (the weights once and the context's K and V) over the rate
this device reads that many bytes again and again (on a CPU with the C kernels their read loop over
a buffer of that size; else the copy's bandwidth). Where the short context's bytes fit a large last
level cache and the long one's do not, the floors' ratio is below 1 before any kernel is slower.

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

import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams
from app.kernels.cpu_memory import read_bandwidth


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


def step_floor(engine: LLMEngine, context: int) -> tuple[int, float]:
    """(bytes one decode step reads at `context` tokens, bytes/s this device reads that many bytes
    over and over: the C kernels' read loop over a buffer of that size on a CPU, else the copy's)."""
    traffic = engine.metrics.traffic
    nbytes = traffic.weight_bytes_per_step(1) + traffic.kv_bytes_read([context])
    cpu = engine.plan.setup.device.type == "cpu"
    rate = read_bandwidth(torch.get_num_threads(), nbytes) if cpu else None
    return nbytes, rate or traffic.memory_bandwidth


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", default="64,3500", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="tokens decoded after each prompt")
    parser.add_argument("--label", default="", help="printed before each line (e.g. the tree's name)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's storage (auto, float16, int8, ...)")


def run(args: argparse.Namespace) -> dict:
    engine = LLMEngine(args.model, kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(0)
    base = base_floor = None
    rows = []
    for n in (int(x) for x in args.context.split(",")):
        ttft, step = decode_after(engine, n, args.tokens, rng)
        nbytes, rate = step_floor(engine, n)
        floor = nbytes / rate
        base, base_floor = base or 1 / step, base_floor or 1 / floor
        print(f"{args.label} context {n}: first token {ttft:.2f} s, decode {1 / step:.1f} tok/s "
              f"({step * 1e3:.1f} ms a step; {1 / step / base:.2f}x the first length's rate); floor "
              f"{floor * 1e3:.1f} ms ({nbytes / 1e6:.0f} MB at {rate / 1e9:.1f} GB/s; its rate "
              f"{1 / floor / base_floor:.2f}x the first's), the step at {floor / step:.0%} of it", flush=True)
        rows.append({"context": n, "ttft_s": round(ttft, 3), "step_ms": round(step * 1e3, 2),
                     "decode_tok_s": round(1 / step, 1), "of_first": round(1 / step / base, 3),
                     "read_mb": round(nbytes / 1e6, 1), "read_gb_s": round(rate / 1e9, 2),
                     "floor_ms": round(floor * 1e3, 2), "floor_of_first": round(1 / floor / base_floor, 3)})
    return {"model": engine.plan.model_name, "rows": rows}
