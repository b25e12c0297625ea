"""How many long Gemma 3 270M sequences a fixed KV budget holds, keeping every token in every layer
against the hybrid cache (sliding-window layers keep their window), in bf16 and int8; and,
optionally, that greedy tokens are the same both ways on long prompts.

    localbatch bench research window_cap [--kv-cache-bytes 1073741824] [--lengths 3000,8000]
                                         [--check-tokens 600,1500,3000]

"Fit" is measured on the engine's own pool and allocator: prompts of the given length arrive and are
prefilled in the engine's chunks, and each stays resident once it has its first token, until no
further prompt can be admitted. The computed bound (pool blocks over the blocks a decoding sequence
holds) is printed next to it.
"""

from __future__ import annotations

import argparse
import random
import time

from app.engine import LLM, SamplingParams
from app.engine.core.block_manager import BlockManager
from app.engine.core.llm_engine import LLMEngine
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence

def resident(engine: LLMEngine, length: int, arrivals: int) -> int:
    """How many sequences of `length` tokens a copy of the engine's pool holds: prompts arrive and
    are prefilled in the engine's chunks; a sequence that has its first token stays resident
    (keeps its blocks, steps no further) until a prompt can no longer be admitted."""
    bm = BlockManager(engine.block_manager.num_blocks, engine.config.block_size, False, engine.plan.kv_spec)
    sched = Scheduler(SchedulerConfig(engine.plan.max_num_batched_tokens, max_num_seqs=4096, max_waiting=4096), bm)
    for i in range(arrivals):
        sched.add(Sequence(f"r{i}", [i % 1000 + 5] * (length - 1), SamplingParams(max_tokens=1), 1))
    parked = []
    while batch := sched.schedule():
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            bm.free_skipped_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(7)
                sched.running.remove(seq)
                parked.append(seq)
    return len(parked)


def fit_table(args: argparse.Namespace) -> list[dict]:
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"KV budget {args.kv_cache_bytes / 2**30:.2f} GiB, Gemma 3 270M, blocks of 16 tokens")
    print(f"{'kv dtype':<10}{'cache':<12}" + "".join(f"{f'{n:,} tok: fit (bound)':>26}" for n in lengths))
    fits: dict[tuple[str, int], dict[bool, int]] = {}
    rows = []
    for dtype in ("bfloat16", "int8"):
        for hybrid in (False, True):
            engine = LLMEngine("gemma3-270m", device="cpu", dtype="bfloat16", kv_cache_bytes=args.kv_cache_bytes,
                               kv_cache_dtype=dtype, disable_hybrid_kv_cache_manager=not hybrid,
                               max_model_len=max(lengths) + 64)
            cells = []
            for n in lengths:
                bound = engine.block_manager.num_blocks // engine.plan.kv_spec.blocks_for_tokens(n)
                fit = resident(engine, n, bound + 4)
                fits.setdefault((dtype, n), {})[hybrid] = fit
                rows.append({"kv_dtype": dtype, "window_cap": hybrid, "tokens": n, "fit": fit, "bound": bound})
                cells.append(f"{fit:>17,} ({bound:,})")
            print(f"{dtype:<10}{'window cap' if hybrid else 'every token':<12}" + "".join(f"{c:>26}" for c in cells))
            del engine
    for (dtype, n), by in fits.items():
        print(f"{dtype} {n:,} tokens: window cap x{by[True] / by[False]:.2f}")
    for n in lengths:
        print(f"{n:,} tokens: int8 + window cap against bf16 keeping every token "
              f"x{fits['int8', n][True] / fits['bfloat16', n][False]:.2f}")
    return rows


def check_tokens(args: argparse.Namespace) -> bool:
    rng = random.Random(0)
    reqs = [[2] + [rng.randrange(1000, 200000) for _ in range(int(n) - 1)] for n in args.check_tokens.split(",")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", kv_cache_blocks=4096)
    start = time.perf_counter()
    keep_all = LLM("gemma3-270m", disable_hybrid_kv_cache_manager=True, **common)
    alone = [keep_all.generate([p], params)[0].token_ids for p in reqs]
    del keep_all
    capped = LLM("gemma3-270m", max_num_batched_tokens=384, **common)  # chunked, and the prompts batched
    together = [out.token_ids for out in capped.generate(reqs, params)]
    same = "identical" if together == alone else "DIFFERENT"
    print(f"greedy tokens, prompts of {args.check_tokens} tokens, fp32: window cap (batched, chunks of 384) "
          f"vs every token (one by one): {same} ({time.perf_counter() - start:.0f} s)")
    return together == alone


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--lengths", default="3000,8000")
    parser.add_argument("--check-tokens", default="", help="prompt lengths to compare greedy tokens on")


def run(args: argparse.Namespace) -> dict:
    results: dict = {"rows": fit_table(args)}
    if args.check_tokens:
        results["same_tokens"] = results["ok"] = check_tokens(args)
    return results
