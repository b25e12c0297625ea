"""The `localbatch bench` command line: one parser per benchmark, and the dispatch.

    localbatch bench [throughput] ...   offline throughput and a concurrency sweep (the default)
    localbatch bench latency ...        one batch end to end, latency percentiles
    localbatch bench serve ...          streaming clients against `localbatch serve` or --url
    localbatch bench tui ...            the terminal app against its own engine
    localbatch bench compare ...        against llama.cpp on the same GGUF, back to back
    localbatch bench complete ...       code completion (/infill) follow-ups after small edits
    localbatch bench research NAME ...  one of the research benchmarks under benchmarks/ (a checkout)
    localbatch bench kernels ...        each quant type's prompt GEMM against this CPU's int8 peak
    localbatch bench report RECORD...   the records' tables as Markdown, with commit, machine and date
    localbatch bench setup-llama-cpp    build the pinned llama.cpp `compare` and `complete` run against

Every benchmark takes `--json PATH` (a record with the commit, the CPU and its flags, torch and
the settings; "-" or `--json` alone: that record on stdout instead of the text report).

The command line (`app.cli`) hands in its engine options (`add_engine_args`) and, once a run
starts, the engine settings they give; nothing here imports the engine (torch) until then, so
`--help` stays cheap."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.results import add_json_arg

AddArgs = Callable[[argparse.ArgumentParser], None]
# The command line's `add_engine_args`: adds the engine options and returns them, in order.
AddEngineArgs = Callable[[argparse.ArgumentParser], list[argparse.Action]]
Progress = Callable[[str, float | None], None]

HELP = {
    "throughput": "offline throughput on synthetic requests, and a concurrency sweep (the default)",
    "latency": "one batch of requests end to end, --num-iters times: latency percentiles",
    "serve": "streaming clients against `localbatch serve` (started here) or any server at --url",
    "tui": "the terminal app against its own engine: decode tok/s with N tabs streaming, and without the app",
    "compare": "against llama.cpp (llama-batched-bench) on the same GGUF, back to back",
    "complete": "code completion: /infill follow-ups after small edits near the cursor (TTFT, latency)",
}


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the throughput run")
    _lengths(p)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (vllm's random-range-ratio)")
    p.add_argument("--input-range", default=None, help="MIN,MAX prompt tokens (overrides --input-len)")
    p.add_argument("--output-range", default=None, help="MIN,MAX generated tokens (overrides --output-len)")
    p.add_argument("--concurrency", default=None, help="comma list, e.g. 1,2,4,8,16: sweep decode tok/s")
    _random_weights(p)
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also measure structured output: decode tok/s at each --concurrency (default 8) "
                        "with half the requests constrained to this JSON schema, against none constrained")


def _lengths(p: argparse.ArgumentParser, output_len: int = 64) -> None:
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=output_len, help="generated tokens (mean)")
    p.add_argument("--seed", type=int, default=0)


def _random_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", default=None, metavar="ARCH:SIZE",
                   help="real model shapes with random weights, no file (e.g. qwen3:0.6b, llama:8b)")


def _add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    _lengths(p)
    p.add_argument("--num-iters", type=int, default=5, help="timed batches")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="batches run first, not timed")
    _random_weights(p)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server (http://HOST:PORT); default: start "
                                               "`localbatch serve` with these engine options on a free port")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: random token-id prompts; chat: one user message (the app's tabs' question)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of client counts")
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-len", type=int, default=128, help="completions: random token ids per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    p.add_argument("--max-token-id", type=int, default=30000, help="completions: prompt ids are drawn below this")


def _add_tui_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tabs", default="1,4,8", help="comma list of tab counts")
    _lengths(p, output_len=256)


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,4,8,16", help="concurrencies to decode at (0: none, prefill only)")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, alternating which engine goes first")
    p.add_argument("--prefill-len", default="512",
                   help="also time one prompt of each of these lengths (e.g. 512,2048,4096) to its first token, "
                        "and the 32 tokens decoded after it; 0: skip")
    p.add_argument("--svg", type=Path, default=None, help="write the scaling curve here")
    _llama_cpp_arg(p)


def _add_complete_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server with /infill; default: start `localbatch serve`")
    p.add_argument("--followups", type=int, default=12, help="requests after the first, each after a one-line edit")
    p.add_argument("--prompts", type=int, default=0,
                   help="also N completions at cursors cut from Python sources, compared between servers")
    p.add_argument("--n-predict", type=int, default=16, help="tokens per completion")
    p.add_argument("--file", type=Path, default=None, help="the edited file (default: the package's cli.py)")
    p.add_argument("--cursor-line", type=int, default=170, help="the cursor's line in --file (0-based)")
    p.add_argument("--compare-llama-server", action="store_true",
                   help="also run llama.cpp's llama-server on the same GGUF")
    _llama_cpp_arg(p)


def _llama_cpp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="a llama.cpp build folder (default: the one `localbatch bench setup-llama-cpp` builds)")


_ADDERS: dict[str, AddArgs] = {"throughput": add_throughput_args, "latency": _add_latency_args,
                               "serve": _add_serve_args, "tui": _add_tui_args, "compare": _add_compare_args,
                               "complete": _add_complete_args}


# The KV disk tier off (a setting like the others, so a `serve` bench starts gets it too): a run
# would read an earlier run's prompts from disk.
BENCH_ENGINE_DEFAULTS = {"kv_disk_cache_bytes": 0}


def add_bench_parser(sub: Any, add_engine_args: AddEngineArgs) -> argparse.ArgumentParser:
    """`bench` and its benchmarks under `sub` (the command line's subparsers). Plain `localbatch
    bench [options]` is `bench throughput` (and `--tui N,...` is `bench tui --tabs N,...`), as before
    the benchmarks were subcommands."""
    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(HELP), description="\n\n".join(__doc__.split("\n\n")[1:3]),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Options given before a benchmark's name are `bench throughput`'s; give them after it.")
    add_throughput_args(b)
    b.add_argument("--tui", default=None, metavar="N[,N...]", help="the same as `bench tui --tabs N[,N...]`")
    add_json_arg(b)
    add_engine_args(b)
    b.set_defaults(**BENCH_ENGINE_DEFAULTS)
    benchmarks = b.add_subparsers(dest="bench_command", metavar="BENCHMARK", title="benchmarks")
    for name, add in _ADDERS.items():
        p = benchmarks.add_parser(name, help=HELP[name], description=f"localbatch bench {name}: {HELP[name]}. "
                                  "How to run it and what it reports: docs/benchmarks.md.")
        add(p)
        add_json_arg(p)
        add_engine_args(p)
        p.set_defaults(**BENCH_ENGINE_DEFAULTS)
    for name, (help_text, add) in _TOOL_ADDERS.items():
        add(benchmarks.add_parser(name, help=help_text, description=f"localbatch bench {name}: {help_text}."))
    return b


def _add_research_args(p: argparse.ArgumentParser) -> None:
    from app.bench.research import RESEARCH

    p.description = (p.description or "") + " " + " ".join(f"{name}: {r.question}" for name, r in RESEARCH.items())
    p.add_argument("research", choices=list(RESEARCH), metavar="NAME", help="one of: " + ", ".join(RESEARCH))
    p.add_argument("options", nargs=argparse.REMAINDER, help="its options (`localbatch bench research NAME --help`)")


def _add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="+", type=Path, metavar="RECORD", help="JSON records written with --json")


def _add_kernels_args(p: argparse.ArgumentParser) -> None:
    from app.bench.kernels import add_args

    add_args(p)
    add_json_arg(p)


def _add_setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=None,
                   help="where to build (default: llama.cpp/<release> in the user cache dir)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")


_TOOL_ADDERS: dict[str, tuple[str, AddArgs]] = {
    "research": ("a research benchmark from benchmarks/ (run from a checkout), through the same options and "
                 "JSON record", _add_research_args),
    "report": ("Markdown tables from --json records, each under its commit, machine (CPU, flags) and date",
               _add_report_args),
    "kernels": ("each quant type's prompt GEMM (the C kernels) at the catalog models' shapes, in GMAC/s and as a "
                "share of this CPU's int8 peak, which it measures too", _add_kernels_args),
    "setup-llama-cpp": ("download llama.cpp's pinned release from GitHub (a network action, like `pull`) and build "
                        "it for this CPU into the cache, for `bench compare` and `bench complete`", _add_setup_args),
}


def engine_argv(args: argparse.Namespace, add_engine_args: AddEngineArgs, skip: tuple[str, ...] = ()) -> list[str]:
    """The engine options `args` holds that differ from their defaults, as a command line (for a
    `localbatch serve` or `bench` subprocess), in the order `add_engine_args` added them. `skip`:
    dests left out."""
    parser = argparse.ArgumentParser()
    options = add_engine_args(parser)
    defaults = vars(parser.parse_args([]))
    argv: list[str] = []
    for action in options:
        dest = action.dest
        if dest not in defaults or dest in skip or not action.option_strings:
            continue
        value = getattr(args, dest, defaults[dest])
        if value is None or value == defaults[dest]:
            continue
        argv += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return argv


def run_bench(args: argparse.Namespace, engine_kwargs: Callable[[], dict[str, Any]], add_engine_args: AddEngineArgs,
              progress: Progress | None = None) -> int:
    """Run the benchmark `args` names; `engine_kwargs()` gives the engine settings (it checks the
    model, so it is called only by the benchmarks that build an engine here)."""
    if args.bench_command in _TOOLS:
        return _TOOLS[args.bench_command](args)
    name = args.bench_command or ("tui" if args.tui else "throughput")
    if args.bench_command is None and args.tui:
        args.tabs = args.tui
    results, text, device = _RUNNERS[name](args, engine_kwargs, add_engine_args, progress)
    if args.json:
        from app.bench.results import record, settings, write

        write(args.json, record(name, settings(args), results, device))
    if args.json != "-" and text:
        if progress is not None:
            progress("", None)
        print(text)
    return 0


def _throughput(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.throughput import format_throughput, run_throughput

    r = run_throughput(args, engine_kwargs(), progress)
    return r, format_throughput(r), r["device"]


def _latency(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.throughput import format_latency, run_latency

    r = run_latency(args, engine_kwargs(), progress)
    return r, format_latency(r), r["device"]


def _serve(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.serve import run_serve
    from app.bench.server import free_port, localbatch_serve_cmd, running
    from app.bench.stream import Load

    load = Load(args.endpoint, args.prompt_len, args.max_tokens, args.max_token_id)
    levels = [int(x) for x in args.concurrency.split(",")]
    log = (lambda line: None) if args.json == "-" else print
    if args.url:
        r = run_serve(args.url.rstrip("/"), levels, args.rounds, load, log=log)
    else:
        engine_kwargs()  # an unknown model fails here, in one line
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with running(localbatch_serve_cmd(engine_argv(args, add_engine_args), port), url):
            r = run_serve(url, levels, args.rounds, load, log=log)
    return r, "", None if args.url else args.device  # the rows were printed as they came


def _tui(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.tui import format_tui_runs, run_tui_bench, tui_results

    runs = run_tui_bench(args, engine_kwargs(), progress)
    return tui_results(runs), format_tui_runs(runs), args.device


def _compare(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.compare import format_report, run_compare, write_svg
    from app.bench.llama_cpp import binary
    from app.bench.results import cpu_model_and_flags
    from app.engine.gguf.catalog import resolve_model

    llama_bench = str(binary("llama-batched-bench", args.llama_cpp))  # before the engine loads
    engine_kwargs()
    model = resolve_model(args.model)
    if model is None:
        from app.engine.gguf.default_model import default_model_path

        model = str(default_model_path())
    batches = [int(b) for b in args.batches.split(",") if b.strip() and int(b) > 0]
    prefill = [int(n) for n in args.prefill_len.split(",") if int(n) > 0]
    r = run_compare(model, llama_bench, batches, prefill, args.rounds, engine_argv(args, add_engine_args, skip=("model",)))
    if args.svg:
        write_svg(args.svg, r, cpu_model_and_flags()[0])
    return r, format_report(r), args.device


def _complete(args, engine_kwargs, add_engine_args, progress):  # noqa: ANN001, ANN202
    from app.bench.complete import Target, format_report, llama_server_cmd, run_complete
    from app.bench.datasets import FollowUps
    from app.bench.server import free_port, localbatch_serve_cmd

    targets = []
    if args.compare_llama_server:
        from app.bench.llama_cpp import binary

        llama_server = str(binary("llama-server", args.llama_cpp))  # before anything starts
    if args.url:
        targets.append(Target("server", args.url.rstrip("/")))
    else:
        engine_kwargs()
        port = free_port()
        targets.append(Target("localbatch", f"http://127.0.0.1:{port}",
                              localbatch_serve_cmd(engine_argv(args, add_engine_args), port)))
    if args.compare_llama_server:
        from app.engine.gguf.catalog import resolve_model

        gguf = resolve_model(args.model)
        if gguf is None:
            from app.engine.types.errors import LocalbatchError

            raise LocalbatchError("--compare-llama-server needs --model (a GGUF file or a pulled catalog name)")
        port = free_port()
        targets.append(Target("llama-server", f"http://127.0.0.1:{port}",
                              llama_server_cmd(llama_server, gguf, port)))
    followups = FollowUps(cursor_line=args.cursor_line) if args.file is None else \
        FollowUps(file=args.file, cursor_line=args.cursor_line)
    log = (lambda line: None) if args.json == "-" else print
    r = run_complete(targets, followups, args.followups + 1, args.prompts, args.n_predict, log=log)
    return r, format_report(r), None if args.url else args.device


def _research(args: argparse.Namespace) -> int:
    from app.bench.research import run_research

    return run_research(args.research, args.options)


def _report(args: argparse.Namespace) -> int:
    from app.bench.report import report

    print(report(args.records))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    import sys

    from app.bench.kernels import run
    from app.bench.results import record, settings, write

    log = (lambda line: print(line, file=sys.stderr)) if args.json == "-" else print
    results = run(args, log)
    if args.json:
        write(args.json, record("kernels", settings(args), results, "cpu"))
    return 0


def _setup_llama_cpp(args: argparse.Namespace) -> int:
    from app.bench.llama_cpp import default_dir, setup
    from app.kernels.cpu_info import cpu_flags

    bin_dir = setup(args.dir or default_dir(), cpu_flags(), args.jobs or os.cpu_count() or 1)
    print(f"llama.cpp built in {bin_dir}" + (f"; pass --llama-cpp {args.dir} to the benchmarks" if args.dir else ""))
    return 0


_TOOLS: dict[str, Callable[[argparse.Namespace], int]] = {"research": _research, "report": _report,
                                                         "kernels": _kernels, "setup-llama-cpp": _setup_llama_cpp}
_RUNNERS = {"throughput": _throughput, "latency": _latency, "serve": _serve, "tui": _tui, "compare": _compare,
            "complete": _complete}
