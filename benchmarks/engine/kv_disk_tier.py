"""The KV disk tier, in three parts (`--parts`, all by default):

- restart: a ~4,096-token chat (a file and a question, answered) reopened after a restart asks a
  new question. Its time to first token with the tier on, over the blocks the first engine wrote,
  against the same prompt in an engine with the tier off (that reads it all), and the first
  question's cold TTFT; the greedy tokens after a restart must equal the tier-off ones. Per KV dtype.
- infill: an editor's /infill follow-ups (extra chunks from other files, a prefix and a suffix,
  laid out as `app.server.fim` lays them out) over files an earlier process read: the first
  follow-up after a restart against the next one, warm in memory (the ratio; target <= 1.2).
- rates: uncached work (prompts of fresh random tokens) alternated between an engine with the tier
  on and one with it off: prefill and decode rates, and the p99 step time of each.

    localbatch bench research kv_disk_tier [--model qwen2.5-coder-1.5b-instruct] [--parts restart,infill,rates]
        [--kv-cache-dtype auto,int8] [--prompt-tokens 4096] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.sampling_params import SamplingParams

_SOURCES = Path(__file__).resolve().parents[2] / "app" / "engine" / "core"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--parts", default="restart,infill,rates", help="which parts to run, comma-separated")
    ap.add_argument("--kv-cache-dtype", default="auto,int8", help="KV dtypes of the restart part")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="the reopened chat's length")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the rates part")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="prompt length in the rates part")


def run(args: argparse.Namespace) -> dict:
    parts = set(args.parts.split(","))
    out: dict = {"model": args.model}
    if "restart" in parts:
        out["restart"] = [restart_row(args, kv) for kv in args.kv_cache_dtype.split(",")]
    if "infill" in parts:
        out["infill"] = infill_row(args)
    if "rates" in parts:
        out["rates"] = rates_row(args)
    out["ok"] = all(r["tokens_identical"] for r in out.get("restart", [])) and out.get("infill", {}).get(
        "tokens_identical", True)
    return out


# ---- helpers ------------------------------------------------------------------------------------
def timed(engine: LLMEngine, prompt, max_tokens: int, steps: list[float] | None = None) -> dict:
    """One request run alone: TTFT, decode rate, tokens, prompt tokens and those from disk."""
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    first = None
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        if steps is not None:
            steps.append(time.perf_counter() - t)
        if first is None and seq.num_output_tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    n = seq.num_output_tokens
    return {"ttft": first - start, "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "tokens": seq.output_token_ids, "prompt": seq.num_prompt_tokens, "disk": seq.num_disk_cached_tokens}


def source_text(engine: LLMEngine, tokens: int) -> str:
    """This package's engine-core sources, cut to about `tokens` tokens of `engine`'s tokenizer."""
    tok = engine.inputs.require_tokenizer()
    text = "\n\n".join(p.read_text() for p in sorted(_SOURCES.glob("*.py")))
    for _ in range(3):  # a cut by the characters-per-token ratio, refined
        n = len(tok.encode(text, add_bos=False))
        if abs(n - tokens) < 32:
            break
        text = text[: int(len(text) * tokens / n)]
    return text


def engine_for(args: argparse.Namespace, kv: str = "auto", directory: str | None = None, **kw) -> LLMEngine:
    tier = dict(kv_disk_cache_dir=directory, kv_disk_cache_bytes=4 << 30) if directory else {}
    return LLMEngine(model=args.model, kv_cache_dtype=kv, **tier, **kw)


def close(engine: LLMEngine) -> None:
    engine.close()
    del engine
    gc.collect()


# ---- restart ------------------------------------------------------------------------------------
def restart_row(args: argparse.Namespace, kv: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        first = engine_for(args, kv, d)
        text = source_text(first, args.prompt_tokens - 64)
        chat = [{"role": "user", "content": f"{text}\n\nWhat does this code do?"}]
        cold = timed(first, chat, args.tokens)
        answer = first.inputs.require_tokenizer().decode(cold["tokens"])
        reopened = chat + [{"role": "assistant", "content": answer},
                           {"role": "user", "content": "Which function admits waiting requests?"}]
        close(first)  # the app quits: its queued writes are flushed
        second = engine_for(args, kv, d)
        warm = timed(second, reopened, args.tokens)
        disk = second.stats().kv_disk
        close(second)
    off_engine = engine_for(args, kv)
    off = timed(off_engine, reopened, args.tokens)
    close(off_engine)
    row = {"kv_cache_dtype": kv, "prompt_tokens": warm["prompt"], "from_disk_tokens": warm["disk"],
           "cold_ttft_s": round(cold["ttft"], 3), "restart_ttft_s": round(warm["ttft"], 3),
           "tier_off_ttft_s": round(off["ttft"], 3), "mb_read": round(disk.bytes_read / 1e6, 1),
           "tokens_identical": warm["tokens"] == off["tokens"]}
    print(f"{args.model} kv={kv}: reopened chat of {row['prompt_tokens']} tokens ({row['from_disk_tokens']} from "
          f"disk, {row['mb_read']} MB read): TTFT after a restart {row['restart_ttft_s']:.2f} s; tier off "
          f"{row['tier_off_ttft_s']:.2f} s; the first question cold {row['cold_ttft_s']:.2f} s; tokens identical to "
          f"tier off: {row['tokens_identical']}", flush=True)
    return row


# ---- infill -------------------------------------------------------------------------------------
def infill_prompt(engine: LLMEngine, files: list[tuple[str, str]], prefix: str, suffix: str,
                  n_predict: int) -> list[int]:
    """The token ids `/infill` would send the engine (`app.server.fim`); a model without FIM tokens
    gets the same parts as plain text (the cache sees the same shape)."""
    from app.server.fim import ExtraChunk, build_fim_prompt

    tok = engine.inputs.require_tokenizer()

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_bos=False, parse_special=False)

    bos = tok.encode("", add_bos=True)
    if tok.fim_tokens is None:
        return bos + encode("".join(f"# {name}\n{text}\n" for name, text in files) + prefix + suffix)
    extra = [ExtraChunk(text, name) for name, text in files]
    return build_fim_prompt(encode, tok.fim_tokens, prefix, suffix, extra=extra, bos=bos,
                            max_model_len=engine.plan.max_model_len, n_predict=n_predict).token_ids


def infill_row(args: argparse.Namespace) -> dict:
    names = ["scheduler.py", "block_manager.py", "sequence.py"]
    files = [(n, (_SOURCES / n).read_text()[:6000]) for n in names]
    current = (_SOURCES / "llm_engine.py").read_text()
    cut = current.index("    def step(")
    typed = ["        # one\n", "        # two\n", "        # three\n"]
    with tempfile.TemporaryDirectory() as d:
        first = engine_for(args, "auto", d)
        prompts = [infill_prompt(first, files, current[:cut] + "".join(typed[: i + 1]), current[cut:cut + 1500],
                                 args.tokens) for i in range(3)]
        timed(first, prompts[0], args.tokens)  # the editor's request before the restart
        close(first)
        second = engine_for(args, "auto", d)
        restart = timed(second, prompts[1], args.tokens)  # the next keystroke, after the restart
        warm = timed(second, prompts[2], args.tokens)  # and the one after it, warm in memory
        close(second)
    off_engine = engine_for(args, "auto")
    off = timed(off_engine, prompts[1], args.tokens)
    close(off_engine)
    row = {"prompt_tokens": restart["prompt"], "from_disk_tokens": restart["disk"],
           "restart_followup_ttft_s": round(restart["ttft"], 3), "warm_followup_ttft_s": round(warm["ttft"], 3),
           "ratio": round(restart["ttft"] / warm["ttft"], 2), "tier_off_ttft_s": round(off["ttft"], 3),
           "tokens_identical": restart["tokens"] == off["tokens"]}
    print(f"{args.model} /infill follow-up over files read before a restart ({row['prompt_tokens']} tokens, "
          f"{row['from_disk_tokens']} from disk): TTFT {row['restart_followup_ttft_s']:.2f} s against "
          f"{row['warm_followup_ttft_s']:.2f} s warm in memory ({row['ratio']}x; target <= 1.2); tier off "
          f"{row['tier_off_ttft_s']:.2f} s; tokens identical: {row['tokens_identical']}", flush=True)
    return row


# ---- rates --------------------------------------------------------------------------------------
def rates_row(args: argparse.Namespace) -> dict:
    """Fresh random prompts (no cache hits), alternated between the tier on and off."""
    rng = random.Random(0)
    blocks = 2 * (args.prefill_tokens + args.tokens) // 16 + 64
    with tempfile.TemporaryDirectory() as d:
        engines = {"on": engine_for(args, "auto", d, kv_cache_blocks=blocks), "off": engine_for(args, "auto",
                                                                                            kv_cache_blocks=blocks)}
        vocab = engines["on"].plan.model_config.vocab_size
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        steps: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                prompt = [rng.randrange(1000, min(vocab, 30000)) for _ in range(args.prefill_tokens)]
                runs[name].append(timed(engines[name], prompt, args.tokens, steps[name]))
        written = engines["on"].stats().kv_disk
        for e in engines.values():
            close(e)
    row = {}
    for name, rs in runs.items():
        row[name] = {"prefill_tps": round(statistics.median(args.prefill_tokens / x["ttft"] for x in rs), 1),
                     "decode_tps": round(statistics.median(x["decode_tps"] for x in rs), 2),
                     "step_p99_ms": round(1e3 * sorted(steps[name])[min(len(steps[name]) - 1,
                                                                         int(0.99 * len(steps[name])))], 1)}
    row["blocks_written"] = written.num_blocks_written
    print(f"{args.model} uncached work, {args.rounds} alternated rounds of {args.prefill_tokens}-token prompts + "
          f"{args.tokens} tokens: tier on prefill {row['on']['prefill_tps']} tok/s, decode {row['on']['decode_tps']} "
          f"tok/s, step p99 {row['on']['step_p99_ms']} ms ({row['blocks_written']} blocks written); tier off "
          f"{row['off']['prefill_tps']}, {row['off']['decode_tps']}, {row['off']['step_p99_ms']} ms", flush=True)
    return row
