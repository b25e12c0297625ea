"""`localbatch bench research NAME`: the research benchmarks, the scripts under benchmarks/ behind
the project's own figures. Each answers one question (listed here, so `--help` needs no script
imported), takes its options through one parser with `--json`, and its results go into the same
record as `localbatch bench`'s (`results.record`).

A script is a module with `add_args(parser)` and `run(args) -> dict` (the results; it prints its
text report as it runs). The scripts ship with the source, not the wheel: run these from a checkout."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from app.bench.results import add_json_arg, record, settings, write
from app.engine.types.errors import LocalbatchError

_CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Research:
    module: str
    question: str


RESEARCH: dict[str, Research] = {
    "attention": Research("benchmarks.kernels.attention",
                          "How fast is the Triton paged attention against torch's SDPA on the same work? (CUDA)"),
    "cpu_attention": Research("benchmarks.kernels.cpu_attention",
                              "How fast is the C paged attention with fp32 against bf16 dot products (AVX512_BF16), "
                              "on a prompt's chunks and a decode?"),
    "decode_roofline": Research("benchmarks.kernels.decode_roofline",
                                "How close is a decode step to the memory roofline (weight + KV bytes over copy bandwidth)?"),
    "q8k_panel": Research("benchmarks.kernels.q8k_panel",
                          "Would llama.cpp's Q8_K activations lift the VNNI panels' Q4_K and Q6_K toward the int8 peak?"),
    "profile_step": Research("benchmarks.kernels.profile_step",
                             "Where does a CPU decode step's time go (torch profiler or cProfile)?"),
    "contention": Research("benchmarks.engine.contention",
                           "With busy neighbour processes, how much does the adaptive thread count save over a fixed one?"),
    "spec_decode": Research("benchmarks.engine.spec_decode",
                            "What does speculative decoding give on an edit and on a question?"),
    "kv_disk_tier": Research("benchmarks.engine.kv_disk_tier",
                             "After a restart, how soon does a long reopened chat or an /infill follow-up answer "
                             "over the disk tier (tokens the same as tier off), and does the tier slow uncached work?"),
    "long_context": Research("benchmarks.engine.long_context",
                             "How much slower is decoding after a long prompt than after a short one?"),
    "window_cap": Research("benchmarks.engine.window_cap",
                           "How many long Gemma 3 sequences fit a KV budget with the sliding-window cap, with the same tokens?"),
    "serve_vs_engine": Research("benchmarks.serving.serve_vs_engine",
                                "Does `localbatch serve` slow its engine (pairs seconds apart, /metrics scraped)?"),
    "handoff": Research("benchmarks.serving.handoff",
                        "What does handing each step's tokens to an event loop cost, apart from HTTP?"),
    "fim_editors": Research("benchmarks.serving.fim_editors",
                            "Do editors' completion streams and streaming chats all keep going on one engine?"),
    "soak": Research("benchmarks.serving.soak",
                     "Does `serve` lose anything under a long mixed load with faults (5xx, leaks, held KV blocks)?"),
    "app_vs_engine": Research("benchmarks.ui.app_vs_engine",
                              "Does the app in a real terminal (tmux) slow its engine (pairs seconds apart)?"),
    "tools": Research("benchmarks.tools.tools",
                      "How often do a model's tool calls parse and validate, and its tool tasks succeed, constrained or not?"),
    "ui_cost": Research("benchmarks.ui.ui_cost",
                        "What CPU does the UI thread take while replies stream, with no model (a paced fake engine)?"),
}


def load(name: str) -> ModuleType:
    """The script `name`, from the checkout this package runs from."""
    if str(_CHECKOUT) not in sys.path and (_CHECKOUT / "benchmarks" / "__init__.py").is_file():
        sys.path.append(str(_CHECKOUT))
    try:
        return importlib.import_module(RESEARCH[name].module)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "benchmarks":
            raise LocalbatchError(f"`localbatch bench research {name}` runs the scripts under benchmarks/ of a "
                                  "source checkout of localbatch, and this install has none") from None
        raise


def parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"localbatch bench research {name}", description=RESEARCH[name].question)
    module.add_args(p)
    add_json_arg(p)
    return p


def run_research(name: str, argv: list[str]) -> int:
    """Parse `argv` with the script's options, run it, write the record where `--json` says (its
    text report goes to stderr when the record takes stdout). Exit status 1 when it says not ok."""
    module = load(name)
    args = parser(name, module).parse_args(argv)
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext()
    with quiet:
        results = module.run(args)
    if args.json:
        device = getattr(args, "device", None) or getattr(module, "DEVICE", "cpu")
        write(args.json, record(name, settings(args), results, device))
    return 1 if results.get("ok") is False else 0
