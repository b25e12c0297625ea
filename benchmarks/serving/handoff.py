"""What handing each step's tokens to an event loop costs the engine, with the machine's drift cancelled.

    localbatch bench research handoff --model smollm2-135m-instruct [--streams 1] [--max-tokens 384] [--rounds 5]

One `AsyncEngine` (adaptive threads, as the app and `serve` run it) and one event loop in this
process. Each round runs the same request twice, alternating which goes first:
- per-token: the stream's deltas go to the loop after every step (`max_delay_s=0`, as `serve` reads them);
- held: after the first token (which never waits) they wait for the request's last step
  (`max_delay_s=inf`), so the loop wakes twice.
The consumer only reads the deltas, so the difference is the hand-off itself (the loop's wake-up,
its Python, the GIL and the CPU it takes from the step thread), not HTTP or a client. Per mode:
tok/s, the engine's mean step and mean time between steps, and per token the loop thread's CPU
time, the step thread's wait for a CPU and its involuntary context switches (/proc, Linux).
The machine must be otherwise quiet."""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from app.bench.stats import median, paired_ratio, step_split
from app.engine.api.async_engine import AsyncEngine
from app.engine.types.sampling_params import SamplingParams

MODES = {"per-token": 0.0, "held": float("inf")}


@dataclass
class ThreadTimes:
    run_ns: int
    wait_ns: int  # runnable but not running
    involuntary: int

    @classmethod
    def read(cls, tid: int) -> ThreadTimes:
        task = Path(f"/proc/self/task/{tid}")
        run, wait = (task / "schedstat").read_text().split()[:2]
        fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        return cls(int(run), int(wait), int(fields["nonvoluntary_ctxt_switches"]))


def _step_thread_id() -> int:
    return next(t.native_id for t in threading.enumerate() if t.name == "localbatch-engine")


async def one_run(engine: AsyncEngine, streams: int, max_tokens: int, prompt_len: int, delay: float,
                  seed: int) -> dict[str, float]:
    step_tid, loop_tid = _step_thread_id(), threading.get_native_id()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def read(i: int) -> None:
        base = 100 + 97 * (seed * streams + i) % 20000
        async for _ in engine.stream(list(range(base, base + prompt_len)), params, max_delay_s=delay):
            pass

    stats0, step0, loop0 = engine.stats(), ThreadTimes.read(step_tid), ThreadTimes.read(loop_tid)
    start = time.perf_counter()
    await asyncio.gather(*(read(i) for i in range(streams)))
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0.2)  # the snapshot after the last step
    stats1, step1, loop1 = engine.stats(), ThreadTimes.read(step_tid), ThreadTimes.read(loop_tid)
    tokens = streams * max_tokens
    return {"tok_s": tokens / elapsed, **step_split(stats0, stats1),
            "loop_cpu_us": (loop1.run_ns - loop0.run_ns) / 1e3 / tokens,
            "step_wait_us": (step1.wait_ns - step0.wait_ns) / 1e3 / tokens,
            "step_preempted": (step1.involuntary - step0.involuntary) / tokens}


async def main_async(args: argparse.Namespace) -> dict:
    engine = AsyncEngine(args.model, device="cpu", adaptive_threads=True)
    try:
        await one_run(engine, args.streams, 32, args.prompt_len, 0.0, seed=999)  # warm-up
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                res = await one_run(engine, args.streams, args.max_tokens, args.prompt_len, MODES[mode], seed=r)
                results[mode].append(res)
                print(f"round {r} {mode:9s} {_row(res)}", flush=True)
        print(f"\n{args.model}, {args.streams} stream(s) of {args.max_tokens} tokens, {args.rounds} rounds "
              f"(medians), load {os.getloadavg()[0]:.2f}")
        for mode, runs in results.items():
            print(f"{mode:9s} " + _row({k: median(r[k] for r in runs) for k in runs[0]}))
        pairs = [(b["tok_s"], a["tok_s"]) for a, b in zip(results["per-token"], results["held"], strict=True)]
        print(f"per-token / held: {paired_ratio(pairs):.3f} ({', '.join(f'{a / b:.3f}' for b, a in pairs)})")
        return {"modes": {mode: {k: median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()},
                "runs": results, "paired_ratio": paired_ratio(pairs)}
    finally:
        await engine.aclose()


def _row(r: dict[str, float]) -> str:
    return (f"{r['tok_s']:7.1f} tok/s  step {r['step_ms']:6.3f} ms  between steps {r['step_gap_us']:5.0f} us  "
            f"loop CPU {r['loop_cpu_us']:5.1f} us/tok  step thread waits {r['step_wait_us']:5.1f} us/tok, "
            f"preempted {r['step_preempted']:.2f}/tok")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(main_async(args))
