"""Decode speed with busy neighbour processes, with the thread tuner on and off.

    localbatch bench research contention --model smollm2-135m-instruct [--neighbours 0,1] [--concurrency 1,4]
        [--seconds 20] [--rounds 1] [--json PATH]

For each neighbour count it starts that many `while True: pass` processes (a browser tab, a build),
then decodes `--concurrency` sequences for `--seconds` with a fixed thread count and again with
`adaptive_threads` (what the app and `serve` use), and prints decode tok/s of both. With `--rounds`
above 1 the two alternate which goes first and the medians are printed, with the median of each
round's adaptive / fixed ratio (paired within seconds, so a drift of the machine's speed cancels).
The neighbours are stopped before the next count. Run it on an otherwise quiet machine."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import torch

from app.bench.paired import alternate
from app.bench.stats import median, paired_ratio
from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams


def decode_rate(engine: LLMEngine, concurrency: int, seconds: float) -> float:
    rng = random.Random(0)
    vocab = engine.plan.model_config.vocab_size
    params = SamplingParams(max_tokens=engine.plan.max_model_len - 64, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request([rng.randrange(100, vocab - 100) for _ in range(32)], params) for _ in range(concurrency)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += len(engine.step())
    elapsed = time.perf_counter() - start
    for s in seqs:
        engine.abort(s.request_id)
    while engine.has_unfinished():
        engine.step()
    return tokens / elapsed


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--neighbours", default="0,1")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1, help="alternated pairs of fixed and adaptive runs (medians)")


def run(args: argparse.Namespace) -> dict:
    results = []
    threads = torch.get_num_threads()
    engines = {False: LLMEngine(args.model, device="cpu"), True: LLMEngine(args.model, device="cpu", adaptive_threads=True)}
    print(f"{'neighbours':>10} {'seqs':>5} {'fixed tok/s':>12} {'adaptive tok/s':>15} {'ratio':>6} {'threads at end':>15}")

    def one_run(adaptive: bool, seqs: int, at_end: list[int]) -> float:
        # Each run starts from the configured count; the tuner forgets the last run.
        torch.set_num_threads(threads)
        engines[True].thread_tuner.__init__(threads)
        rate = decode_rate(engines[adaptive], seqs, args.seconds)
        if adaptive:
            at_end.append(engines[True].thread_tuner.current)
        return rate

    for n in (int(x) for x in args.neighbours.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        try:
            time.sleep(1)
            for c in (int(x) for x in args.concurrency.split(",")):
                at_end: list[int] = []
                pairs = alternate(lambda: one_run(False, c, at_end), lambda: one_run(True, c, at_end), args.rounds)  # noqa: B023
                fixed, adaptive = median(f for f, _ in pairs), median(a for _, a in pairs)
                ratio = paired_ratio(pairs)
                print(f"{n:>10} {c:>5} {fixed:>12.1f} {adaptive:>15.1f} {ratio:>6.2f} "
                      f"{','.join(map(str, at_end)):>15}", flush=True)
                results.append({"neighbours": n, "seqs": c, "fixed": fixed, "adaptive": adaptive,
                                "paired_ratio": ratio, "threads_at_end": at_end[-1],
                                "fixed_runs": [f for f, _ in pairs], "adaptive_runs": [a for _, a in pairs]})
        finally:
            for proc in procs:
                proc.kill()
    return {"rows": results}
