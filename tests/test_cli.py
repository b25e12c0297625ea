"""The command line on a tiny model: `generate --json` and `bench --json`; `--help` and the TUI's
first screen without torch; `bench`'s benchmarks as subcommands, plain `bench` as `bench throughput`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


# Like tests/kernels/test_kernels.py::test_import_is_lazy, in a fresh interpreter; a meta-path hook
# records who first asks for torch or triton (it finds nothing, so imports behave as usual).
_TRACE_HEAVY = """
import json, sys, traceback
class _Heavy:
    stacks = {}
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in ("torch", "triton") and name not in cls.stacks:
            cls.stacks[name] = "".join(traceback.format_stack(limit=30)[:-1])
        return None
sys.meta_path.insert(0, _Heavy)
"""
_REPORT_HEAVY = """
print(json.dumps({name: _Heavy.stacks.get(name, "?") for name in ("torch", "triton") if name in sys.modules}))
"""


def heavy_imports(body: str) -> dict[str, str]:
    """Run `body` in a fresh interpreter; {module: stack of its first import} for torch/triton."""
    proc = subprocess.run([sys.executable, "-c", _TRACE_HEAVY + body + _REPORT_HEAVY], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


BENCHMARKS = ["throughput", "latency", "serve", "tui", "compare", "complete"]


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"],
                                  *(["bench", name, "--help"] for name in BENCHMARKS)])
def test_help_imports_no_torch(argv):
    body = f"""
import contextlib, io
from app.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main({argv!r})
assert "usage: localbatch" in out.getvalue(), out.getvalue()
"""
    heavy = heavy_imports(body)
    assert not heavy, "\n".join(f"{name} imported by:\n{stack}" for name, stack in heavy.items())


def test_tui_first_screen_imports_no_torch(tmp_path):
    """The app object, its config and store, and the loading screen's first paint come before the
    engine (whose factory runs in a worker thread); none of it needs torch."""
    (tmp_path / "config.toml").write_text("")
    body = f"""
import asyncio, threading
from pathlib import Path
from app.ui.app import LocalbatchApp, TuiOptions
from app.ui.loading import LoadingScreen

release = threading.Event()

def factory(progress, model, device, config):  # stands in for the engine; never returns one
    release.wait(10)
    raise RuntimeError("no engine in this test")

async def first_paint():
    app = LocalbatchApp(factory, TuiOptions(data_dir=Path({str(tmp_path / "data")!r}),
                                            config_path=Path({str(tmp_path / "config.toml")!r}), poll_interval=0))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(500):
            if isinstance(app.screen, LoadingScreen):
                break
            await pilot.pause(0.01)
        await pilot.pause()
        assert isinstance(app.screen, LoadingScreen), app.screen
        release.set()
    app.store.close()

asyncio.run(first_paint())
"""
    heavy = heavy_imports(body)
    assert not heavy, "\n".join(f"{name} imported by:\n{stack}" for name, stack in heavy.items())


def test_generate_json(tiny_gguf_factory):
    model = str(tiny_gguf_factory("qwen3", context_length=512))
    proc = run_cli("generate", "--model", model, "--prompt", "hello world", "--max-tokens", "5", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"prompt_ids", "output_ids", "text", "finish_reason"}
    assert 1 <= len(out["output_ids"]) <= 5 and out["finish_reason"] in ("stop", "length")


def test_bench_json_has_sweep(tiny_gguf_factory):
    model = str(tiny_gguf_factory("llama", context_length=512))
    proc = run_cli("bench", "--model", model, "--num-prompts", "3", "--input-len", "20", "--output-len", "6",
                   "--concurrency", "1,2", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "throughput" and report["environment"]["device"] == "cpu"
    assert report["requests"] == 3 and report["output_tokens"] == 18
    for key in ("duration_s", "output_tok_s", "total_tok_s", "ttft_ms", "tpot_ms"):
        assert key in report
    assert [s["concurrency"] for s in report["sweep"]] == [1, 2]
    assert all(s["decode_tok_s"] > 0 and s["output_tok_s"] > 0 and s["full_batch_tok_s"] > 0 for s in report["sweep"])


def test_bench_subcommands_parse_their_own_options():
    from app.cli import build_parser

    parse = build_parser().parse_args
    plain = parse(["bench", "--num-prompts", "3", "--concurrency", "1,2", "--device", "cpu"])
    assert plain.bench_command is None and plain.num_prompts == 3 and plain.json is None  # = throughput
    named = parse(["bench", "throughput", "--num-prompts", "3", "--json", "out.json"])
    assert (named.bench_command, named.num_prompts, named.json) == ("throughput", 3, "out.json")
    assert parse(["bench", "latency", "--batch-size", "4", "--json"]).json == "-"  # --json alone: stdout
    assert parse(["bench", "tui", "--tabs", "1,2"]).tabs == "1,2" and parse(["bench", "--tui", "2"]).tui == "2"
    serve = parse(["bench", "serve", "--url", "http://127.0.0.1:9", "--endpoint", "chat", "--concurrency", "2"])
    assert (serve.url, serve.endpoint, serve.concurrency) == ("http://127.0.0.1:9", "chat", "2")
    complete = parse(["bench", "complete", "--followups", "3", "--compare-llama-server"])
    assert complete.followups == 3 and complete.compare_llama_server and complete.llama_cpp is None  # the default build
    assert parse(["bench", "compare", "--batches", "0", "--prefill-len", "512"]).batches == "0"
    for name in BENCHMARKS:  # every benchmark takes the engine options
        assert parse(["bench", name, "--model", "m.gguf", "--num-threads", "1"]).num_threads == 1


def test_engine_argv_gives_back_the_options_that_differ():
    """What `bench serve` and `bench complete` pass on to the `localbatch serve` they start."""
    from app.bench.commands import engine_argv
    from app.cli import add_engine_args, build_parser

    args = build_parser().parse_args(["bench", "serve", "--model", "m.gguf", "--device", "cpu", "--num-threads", "1",
                                      "--no-prefix-caching", "--kv-cache-dtype", "int8"])
    argv = engine_argv(args, add_engine_args)
    # The disk tier stays off in the server a benchmark starts (bench's default), unless a budget is given.
    assert argv == ["--model", "m.gguf", "--device", "cpu", "--kv-disk-cache-bytes", "0", "--num-threads", "1",
                    "--no-prefix-caching", "--kv-cache-dtype", "int8"]
    assert engine_argv(args, add_engine_args, skip=("model",))[:2] == ["--device", "cpu"]
    assert engine_argv(build_parser().parse_args(["bench", "serve"]), add_engine_args) == ["--kv-disk-cache-bytes", "0"]
    budget = build_parser().parse_args(["bench", "serve", "--kv-disk-cache-bytes", "1000"])
    assert engine_argv(budget, add_engine_args) == ["--kv-disk-cache-bytes", "1000"]


def test_bench_latency_json_record(tiny_gguf_factory, tmp_path):
    model = str(tiny_gguf_factory("llama", context_length=512))
    out = tmp_path / "latency.json"
    proc = run_cli("bench", "latency", "--model", model, "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                   "--num-iters", "2", "--json", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "latency (s)" in proc.stdout
    record = json.loads(out.read_text())
    assert record["benchmark"] == "latency" and record["settings"]["batch_size"] == 2
    assert {"commit", "cpu", "cpu_flags", "torch", "device"} <= record["environment"].keys()
    assert len(record["latencies_s"]) == 2 and record["latency_s"]["p50"] > 0


def test_invalid_engine_setting_is_one_line(tiny_gguf_factory):
    model = str(tiny_gguf_factory("llama", context_length=512))
    proc = run_cli("generate", "--model", model, "--prompt", "x", "--max-num-seqs", "0", "--device", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["localbatch: error: invalid max_num_seqs=0: must be a positive integer"]


def test_doctor_says_what_the_engine_will_run(capsys):
    from app.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python / torch", "CPU", "C compiler", "C kernels", "CUDA", "--device auto", "models"):
        assert key in out
    assert "cpu · " in out or "cuda · " in out
    from app.kernels import cpu_attention

    if cpu_attention.library() is not None:  # the attention's arithmetic is named
        assert f"attention {cpu_attention.math_name()}" in out


def test_the_backend_is_named_and_says_why_the_c_kernels_are_off(monkeypatch):
    import torch

    from app.engine.runtime.device import DeviceSetup
    from app.kernels import cpu_build, cpu_qgemm

    if cpu_qgemm.enabled():
        assert DeviceSetup(torch.device("cpu"), torch.float32).backend == f"C kernels ({cpu_qgemm.isa()})"
    monkeypatch.setattr(cpu_qgemm, "enabled", lambda: False)
    monkeypatch.setattr(cpu_build, "library", lambda: cpu_build.KernelLibrary(None, "no C compiler found"))
    assert DeviceSetup(torch.device("cpu"), torch.float32).backend == "torch kernels: no C compiler found"
    assert DeviceSetup(torch.device("cuda"), torch.bfloat16).backend == "Triton kernels"


def test_the_disk_tier_is_a_setting_with_each_commands_default():
    """On in serve, off in bench (and in the serve a bench starts), as the engine's other settings flow."""
    from app.cli import build_parser, engine_kwargs
    from app.engine.types.engine_config import DEFAULT_KV_DISK_CACHE_BYTES

    assert engine_kwargs(build_parser().parse_args(["serve"]))["kv_disk_cache_bytes"] == DEFAULT_KV_DISK_CACHE_BYTES
    assert engine_kwargs(build_parser().parse_args(["serve", "--kv-disk-cache-bytes", "0"]))["kv_disk_cache_bytes"] == 0
    assert engine_kwargs(build_parser().parse_args(["bench", "latency"]))["kv_disk_cache_bytes"] == 0
    assert engine_kwargs(build_parser().parse_args(["bench"]))["kv_disk_cache_bytes"] == 0
    assert "kv_disk_cache_bytes" not in engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))


def test_the_apps_config_sets_the_kv_disk_tier_and_the_flags_win(tmp_path, monkeypatch):
    """The app reads its config once and hands it to the engine factory: the disk tier on by
    default, the config's settings over that, the command line's over both."""
    from functools import partial

    import app.engine
    from app.engine.types.engine_config import DEFAULT_KV_DISK_CACHE_BYTES
    from app.ui.loading import default_engine_factory
    from app.ui.user_config import load_config

    built = []
    monkeypatch.setattr(app.engine, "AsyncEngine", lambda **kw: built.append(kw) or "engine", raising=False)
    path = tmp_path / "config.toml"
    path.write_text('kv_disk_cache_dir = "~/kv"\nkv_disk_cache_bytes = 1000\n')
    config = load_config(path, explicit=True)
    assert config.engine_settings()["kv_disk_cache_bytes"] == 1000
    assert not config.engine_settings()["kv_disk_cache_dir"].startswith("~")
    assert default_engine_factory(None, "m", None, config) == "engine"
    assert built[-1]["kv_disk_cache_bytes"] == 1000 and built[-1]["kv_disk_cache_dir"] == config.kv_disk_cache_dir
    partial(default_engine_factory, kv_disk_cache_bytes=0)(None, "m", "cpu", config)  # the command line's flag
    assert built[-1]["kv_disk_cache_bytes"] == 0 and built[-1]["device"] == "cpu"
    default_engine_factory(None, None, None, load_config(tmp_path / "none.toml"))
    assert built[-1]["kv_disk_cache_bytes"] == DEFAULT_KV_DISK_CACHE_BYTES and "device" not in built[-1]


def test_doctor_shows_the_disk_tier_of_the_apps_config(tmp_path):
    from app.cli import _disk_tier_summary

    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "a.kvb").write_bytes(b"x" * 2000)
    path = tmp_path / "config.toml"
    path.write_text(f'kv_disk_cache_dir = "{tmp_path / "kv"}"\nkv_disk_cache_bytes = 3000000\n')
    assert _disk_tier_summary(str(path)) == (f"{tmp_path / 'kv'}: 1 blocks, 2.0 KB of a 3.0 MB budget in the app "
                                             "and serve (--kv-disk-cache-bytes, 0: off)")
    path.write_text(f'kv_disk_cache_dir = "{tmp_path / "kv"}"\nkv_disk_cache_bytes = 0\n')
    assert _disk_tier_summary(str(path)).startswith("off (kv_disk_cache_bytes = 0 in the config file); ")
