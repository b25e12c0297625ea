"""The command line on a tiny model: `generate --json` and `bench --json`; `--help` and the TUI's
first screen without torch."""

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


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"]])
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

def factory(progress, model, device):  # stands in for the engine; never returns one
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
    assert report["requests"] == 3 and report["output_tokens"] == 18
    for key in ("duration_s", "output_tok_s", "total_tok_s", "ttft_ms", "tpot_ms"):
        assert key in report
    assert [s["concurrency"] for s in report["sweep"]] == [1, 2]
    assert all(s["decode_tok_s"] > 0 and s["output_tok_s"] > 0 for s in report["sweep"])


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
