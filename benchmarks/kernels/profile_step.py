"""Where a CPU decode step's time goes: the torch profiler over steady decode steps.

    localbatch bench research profile_step --model smollm2-135m-instruct --concurrency 1 [--steps 40]

Admits `--concurrency` requests of `--input-len` random tokens, lets them prefill and decode a few
steps, then profiles `--steps` decode steps. Prints the mean wall time of a step, the time inside
the model forward and the logits, and the ops that take the most self CPU time per step. The rest
of a step (scheduling, metadata, sampling, detokenizing) is the wall time minus the forward.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true", help="only the wall time of a step")
    p.add_argument("--python", action="store_true", help="cProfile's Python functions instead of torch's ops")


def run(args: argparse.Namespace) -> dict:
    engine = LLMEngine(model=args.model, device="cpu")
    rng = random.Random(0)
    vocab = engine.plan.model_config.vocab_size
    for _ in range(args.concurrency):
        ids = [rng.randrange(vocab) for _ in range(args.input_len)]
        engine.add_request(ids, SamplingParams(max_tokens=args.steps * 3 + 40, temperature=0.0, ignore_eos=True))
    while engine.metrics.last is None or engine.metrics.last.num_tokens != args.concurrency:
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"step: median {times[len(times) // 2] * 1e3:.2f} ms, best {times[0] * 1e3:.2f} ms "
          f"({args.concurrency / times[len(times) // 2]:.1f} tok/s at the median)")
    results = {"step_ms_p50": round(times[len(times) // 2] * 1e3, 3), "step_ms_min": round(times[0] * 1e3, 3)}
    if args.no_profile:
        return results
    if args.python:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [engine.step() for _ in range(args.steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        return results
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("step"):
                engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(f"per {args.steps} steps:\n{table}")
    return results
