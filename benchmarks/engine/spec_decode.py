"""Speculative decoding against plain decoding, on one engine, greedy.

    localbatch bench research spec_decode --model qwen2.5-coder-1.5b-instruct \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' [--batches 1,8,16]
        [--max-tokens 400] [--tasks edit,question]

Two tasks: "edit" hands the model a 60-line function and asks for it back with a variable
renamed (the reply repeats most of the prompt: where prompt lookup shines), "question" asks for an
explanation with a short example. For each task and batch size the same requests run with
speculation off and on (the engine's toggle, so both use the same weights and threads), and the
script prints decode tok/s (first to last token of each request, summed over requests), the ratio,
the acceptance rate, tokens per speculating step, the share of step time spent drafting, and
whether the tokens were identical (greedy speculation must not change them). Off and on run back to
back `--rounds` times; the rates are medians, the ratio the median of the pairs' ratios.

`--llama-server` runs the same requests (one at a time) through llama.cpp's `llama-server` (all cores)
with each `--llama-spec` mode (`none`, `ngram-simple`, `ngram-map-k`, `ngram-mod`, `draft`:
`-md DRAFT --spec-draft-n-max 4`) and prints its decode tok/s and draft acceptance, back to back
with the runs above; `--llama-cpp DIR` names the build (default: `localbatch bench setup-llama-cpp`'s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request

from app.bench.server import free_port, running
from app.engine.core.llm_engine import LLMEngine
from app.engine.core.sequence import Sequence
from app.engine.types.sampling_params import SamplingParams

EDIT_FUNCTION = '''def summarize_orders(orders, tax_rate=0.08, discount_codes=None):
    discount_codes = discount_codes or {}
    x = 0
    count = 0
    skipped = []
    for order in orders:
        if order.get("status") == "cancelled":
            skipped.append(order["id"])
            continue
        items = order.get("items", [])
        if not items:
            skipped.append(order["id"])
            continue
        subtotal = 0
        for item in items:
            price = item["price"]
            quantity = item.get("quantity", 1)
            if quantity <= 0:
                raise ValueError(f"bad quantity in order {order['id']}")
            subtotal += price * quantity
        code = order.get("discount")
        if code in discount_codes:
            rate = discount_codes[code]
            if not 0 <= rate < 1:
                raise ValueError(f"bad discount rate for {code}")
            subtotal *= 1 - rate
        shipping = order.get("shipping", 0)
        if subtotal > 100:
            shipping = 0
        tax = subtotal * tax_rate
        x += subtotal + tax + shipping
        count += 1
    if count == 0:
        return {"total": 0, "count": 0, "average": 0, "skipped": skipped}
    average = x / count
    x = round(x, 2)
    average = round(average, 2)
    report = {
        "total": x,
        "count": count,
        "average": average,
        "skipped": skipped,
    }
    if x > 10000:
        report["tier"] = "gold"
    elif x > 1000:
        report["tier"] = "silver"
    else:
        report["tier"] = "bronze"
    largest = None
    for order in orders:
        value = sum(i["price"] * i.get("quantity", 1) for i in order.get("items", []))
        if largest is None or value > largest[1]:
            largest = (order["id"], value)
    if largest is not None:
        report["largest_order"] = largest[0]
        report["largest_value"] = round(largest[1], 2)
    report["share_of_largest"] = round(largest[1] / x, 4) if largest and x else 0
    return report
'''

TASKS = {
    "edit": f"```python\n{EDIT_FUNCTION}```\n\nRename the variable x to total everywhere and return the whole function.",
    "question": "Explain what a Python generator is, with a short example.",
}


def generate(engine: LLMEngine, prompt: str, batch: int, max_tokens: int) -> tuple[list[Sequence], float, float]:
    """-> the finished sequences, decode tok/s, and seconds spent proposing drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seqs = [engine.add_request([{"role": "user", "content": prompt}], params) for _ in range(batch)]
    spec = engine.speculator
    draft_s0 = spec.propose_s if spec is not None else 0.0
    while engine.has_unfinished():
        engine.step()
    tokens = sum(s.num_output_tokens - 1 for s in seqs)
    span = max(s.last_token_time for s in seqs) - min(s.first_token_time for s in seqs)
    return seqs, tokens / span, (spec.propose_s - draft_s0) if spec is not None else 0.0


def llama_server_rates(binary: str, model: str, draft: str | None, modes: list[str], tasks: list[str],
                       max_tokens: int) -> list[dict]:
    """Decode tok/s of llama-server per spec mode and task, one request at a time, greedy."""
    rows = []
    print(f"{'llama-server':>12} {'task':>9} {'tok/s':>7} {'accept':>7} {'drafted':>8}")
    for mode in modes:
        port = free_port()
        args = [binary, "-m", model, "-t", str(os.cpu_count() or 2), "-c", "4096", "--port", str(port), "-np", "1"]
        if mode == "draft":
            args += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]
        elif mode != "none":
            args += ["--spec-type", mode]
        with running(args, f"http://127.0.0.1:{port}"):
            for task in tasks:
                body = {"messages": [{"role": "user", "content": TASKS[task]}], "temperature": 0,
                        "max_tokens": max_tokens}
                reply = _post(port, "/v1/chat/completions", body)
                t = reply["timings"]
                drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
                print(f"{mode:>12} {task:>9} {t['predicted_per_second']:7.1f} "
                      f"{accepted / drafted if drafted else 0:7.1%} {drafted:8d}", flush=True)
                rows.append({"mode": mode, "task": task, "tok_s": t["predicted_per_second"], "drafted": drafted,
                             "accepted": accepted})
    return rows


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    p.add_argument("--batches", default="1")
    p.add_argument("--tasks", default="edit,question")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs per task and batch (medians are shown)")
    p.add_argument("--llama-server", action="store_true", help="also run llama.cpp's llama-server in its modes")
    p.add_argument("--llama-cpp", default=None, metavar="DIR", help="the llama.cpp build (default: setup-llama-cpp's)")
    p.add_argument("--llama-spec", default="none,ngram-simple,ngram-map-k,ngram-mod,draft")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model for llama-server's draft mode")
    p.add_argument("--skip-localbatch", action="store_true")


def run(args: argparse.Namespace) -> dict:
    results: dict = {}
    if args.llama_server:
        from app.bench.llama_cpp import binary
        from app.engine.gguf.catalog import resolve_model

        results["llama_server"] = llama_server_rates(str(binary("llama-server", args.llama_cpp)),
                                                     resolve_model(args.model), resolve_model(args.draft),
                                                     args.llama_spec.split(","), args.tasks.split(","), args.max_tokens)
    if args.skip_localbatch:
        return results
    results["rows"] = rows = []
    config = json.loads(args.speculative_config)
    engine = LLMEngine(args.model, device="cpu", speculative_config=config)
    spec = engine.speculator
    print(f"# {engine.plan.model_name}, speculative_config={json.dumps(config)}")
    print(f"{'task':>9} {'seqs':>4} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6} {'accept':>7} "
          f"{'tok/step':>8} {'draft %':>7} {'same tokens':>11}")
    generate(engine, "Say hi.", 1, 4)  # warm up: first-call allocations and the thread pool
    for task in args.tasks.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            base_rates, rates, ratios = [], [], []
            drafted0, accepted0, steps0 = spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_spec_steps
            wall = draft_s = 0.0
            for _ in range(args.rounds):  # off then on, back to back: the VM's drift moves both of a pair
                spec.enabled = False
                base, r0, _ = generate(engine, TASKS[task], batch, args.max_tokens)
                spec.enabled = True
                start = time.perf_counter()
                seqs, r1, d = generate(engine, TASKS[task], batch, args.max_tokens)
                wall, draft_s = wall + time.perf_counter() - start, draft_s + d
                base_rates.append(r0), rates.append(r1), ratios.append(r1 / r0)
            base_rate, rate, ratio = statistics.median(base_rates), statistics.median(rates), statistics.median(ratios)
            drafted = spec.num_draft_tokens - drafted0
            accepted = spec.num_accepted_tokens - accepted0
            steps = spec.num_spec_steps - steps0
            same = all(a.output_token_ids == b.output_token_ids for a, b in zip(base, seqs))
            print(f"{task:>9} {batch:>4} {base_rate:9.1f} {rate:9.1f} {ratio:6.2f} "
                  f"{accepted / max(drafted, 1):7.1%} {(steps + accepted) / max(steps, 1):8.2f} "
                  f"{draft_s / wall:7.1%} {str(same):>11}")
            rows.append({"task": task, "seqs": batch, "off_tok_s": round(base_rate, 1), "on_tok_s": round(rate, 1),
                         "ratio": round(ratio, 3), "accepted": round(accepted / max(drafted, 1), 3),
                         "tokens_per_step": round((steps + accepted) / max(steps, 1), 2),
                         "draft_share": round(draft_s / wall, 3), "same_tokens": same})
    return results
