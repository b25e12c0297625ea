"""Decode step time against the memory roofline.

A decode step must read every weight once and each sequence's KV context once, so it can be no
faster than (weight bytes + KV bytes) / memory bandwidth. The bandwidth is measured here as a
device-to-device copy (read + write bytes / time) and, on a CPU with the C kernels, as their read
loop (`read_pass`: two prefetched streams a thread, on huge pages, the engine's threads) over as many
bytes as the first batch size's step reads, again and again (a small model may sit in a large last
level cache between steps); the faster of the two is the best a streaming kernel can do here. The
report is the step time of the real engine (scheduler, runner, sampler, CUDA graphs unless
--enforce-eager) at each batch size, and the fraction of that roofline it reaches.

    localbatch bench research decode_roofline --random-weights llama:8b --batch-sizes 1,8,64 --context 512
    localbatch bench research decode_roofline --random-weights gemma3:270m --device cpu --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.runtime.device import copy_bandwidth, synchronize
from app.engine.types.sampling_params import SamplingParams
from app.kernels.cpu_memory import read_bandwidth


# Decode steps an early sequence may take while the batch's later prompts prefill (chunked prefill).
PREFILL_SLACK = 1024


def kv_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """Bytes of K and V that one decode step's attention reads from the pool (its storage dtype):
    each layer sees its window."""
    return engine.metrics.traffic.kv_bytes_read([context] * batch)


def decode_step_time(engine: LLMEngine, batch: int, context: int, steps: int, seed: int) -> float:
    """Seconds per decode step with `batch` sequences whose contexts are about `context` tokens."""
    rng = random.Random(seed)
    vocab = engine.plan.model_config.vocab_size
    # Up to the context limit: sequences prefilled early decode while later ones still prefill.
    params = SamplingParams(max_tokens=engine.plan.max_model_len - context, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)]
    while not all(s.num_output_tokens for s in seqs):  # prefill
        engine.step()
    for _ in range(3):  # first decode steps: graph replays warm, allocator settled
        engine.step()
    synchronize(engine.plan.setup.device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()  # returns after the sampled ids reached the host: the step is complete
    elapsed = time.perf_counter() - t
    if engine.metrics.last.batch_size != batch:
        raise RuntimeError(f"expected decode steps of {batch} sequences, got {engine.metrics.last}")
    for s in seqs:
        engine.abort(s.request_id)
    return elapsed / steps


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", default="llama:8b", help="ARCH:SIZE preset (app/engine/gguf/random_weights.py)")
    p.add_argument("--model", default=None, help="a GGUF file instead of random weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--enforce-eager", action="store_true")


def run(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(batches), enforce_eager=args.enforce_eager,
              max_model_len=args.context + args.steps + PREFILL_SLACK)
    if args.model:
        engine = LLMEngine(args.model, **kw)
    else:
        engine = LLMEngine(random_weights=args.random_weights, **kw)
    device = engine.plan.setup.device
    copy = copy_bandwidth(device, nbytes=1 << 30, repeats=10)
    wbytes = engine.worker.model.weight_bytes_per_step()
    step_bytes = wbytes + kv_bytes(engine, batches[0], args.context)
    read = read_bandwidth(torch.get_num_threads(), nbytes=step_bytes) if device.type == "cpu" else None
    bandwidth = max(copy, read or 0.0)
    rows = []
    for b in batches:
        step = decode_step_time(engine, b, args.context, args.steps, seed=b)
        kbytes = kv_bytes(engine, b, args.context)
        roofline = (wbytes + kbytes) / bandwidth
        rows.append({"batch": b, "step_ms": round(step * 1e3, 3), "tok_s": round(b / step, 1),
                     "weight_gb": round(wbytes / 1e9, 3), "kv_gb": round(kbytes / 1e9, 4),
                     "roofline_ms": round(roofline * 1e3, 3), "of_roofline": round(roofline / step, 3)})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = {"model": engine.plan.model_name, "device": name, "dtype": str(engine.plan.setup.dtype).removeprefix("torch."),
              "cuda_graphs": bool(engine.worker.runner.graphs and engine.worker.runner.graphs.graphs),
              "copy_gb_s": round(copy / 1e9, 1), **({"read_gb_s": round(read / 1e9, 1)} if read else {}),
              "context": args.context}
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>9} {'weights GB':>11} {'KV GB':>8} {'roofline ms':>12} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['step_ms']:>9.3f} {r['tok_s']:>9.1f} {r['weight_gb']:>11.3f} {r['kv_gb']:>8.4f} "
              f"{r['roofline_ms']:>12.3f} {r['of_roofline'] * 100:>11.1f}%")
    return {**header, "rows": rows}
