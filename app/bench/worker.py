"""The engine alone, for paired runs (`app.bench.paired.EngineWorker` starts it):

    python -m app.bench.worker --engine JSON --max-tokens N [--prompt-len N] [--chat-prompt TEXT]

It loads an `LLMEngine` from `--engine` (its keyword arguments as JSON, as the command line's
engine options give them), prints {"ready": true}, then for each stdin line "N SEED" decodes N
requests at concurrency N (greedy, EOS ignored, as `localbatch bench`) and prints one JSON line:
decode_tok_s, output_tok_s, step_ms, step_gap_us."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from app.bench.datasets import Shape, make_requests
    from app.bench.stats import step_split
    from app.bench.throughput import run_requests
    from app.engine.core.llm_engine import LLMEngine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=json.loads, default={}, help="LLMEngine's keyword arguments, as JSON")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--chat-prompt", default=None)
    args = p.parse_args(argv)
    engine = LLMEngine(**args.engine)
    vocab = engine.plan.model_config.vocab_size
    shape = Shape(args.prompt_len, args.max_tokens)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        n, seed = map(int, line.split())
        if args.chat_prompt:  # the app's tabs' request: one user message, through the chat template
            requests = [([{"role": "user", "content": args.chat_prompt}], args.max_tokens)] * n
        else:
            requests = make_requests(shape, n, vocab, seed)
        before = engine.stats()
        summary = run_requests(engine, requests, n).summary()  # type: ignore[arg-type]
        print(json.dumps({"decode_tok_s": summary["decode_tok_s"], "output_tok_s": summary["output_tok_s"],
                          **step_split(before, engine.stats())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
