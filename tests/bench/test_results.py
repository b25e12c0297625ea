"""A benchmark's JSON record: where it came from (commit, CPU, flags, torch, device), its settings,
and its results at the top level."""

from __future__ import annotations

import json
import subprocess

import pytest

from app.bench import results
from app.kernels import cpu_info


def test_record_says_where_the_figures_came_from(tmp_path):
    rec = results.record("throughput", {"num_prompts": 3}, {"output_tok_s": 12.5, "sweep": []}, device="cpu")
    assert rec["benchmark"] == "throughput" and rec["settings"] == {"num_prompts": 3}
    assert rec["output_tok_s"] == 12.5 and rec["sweep"] == []  # results stay where readers of the old report look
    env = rec["environment"]
    assert {"commit", "cpu", "cpu_flags", "cpu_count", "torch", "python", "device", "time"} <= env.keys()
    assert env["device"] == "cpu" and env["torch"] and env["cpu"]
    assert set(env["cpu_flags"]) <= set(results.CPU_FLAGS)
    path = tmp_path / "r.json"
    results.write(str(path), rec)
    assert json.loads(path.read_text()) == rec


def test_results_may_not_shadow_the_records_own_keys():
    with pytest.raises(ValueError, match="environment"):
        results.record("x", {}, {"environment": 1})


def test_stdout_record_is_one_line(capsys):
    results.write("-", {"benchmark": "x", "a": [1, 2]})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out) == {"benchmark": "x", "a": [1, 2]}


def test_cpu_flags_come_from_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 fma avx512f amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
    read_once = (cpu_info.cpu_model, cpu_info.cpu_flags)  # cached: forget the real CPU, then the test one
    for fn in read_once:
        fn.cache_clear()
    try:
        assert results.cpu_model_and_flags() == ("Test CPU 9000", ["avx2", "fma", "avx512f", "amx_tile"])
    finally:
        for fn in read_once:
            fn.cache_clear()


def test_commit_of_a_checkout_and_of_no_checkout(tmp_path):
    assert results.git_commit(tmp_path) is None  # an installed wheel's folder
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("1")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    commit = results.git_commit(tmp_path)
    assert commit and not commit.endswith("-dirty")
    (tmp_path / "f").write_text("2")
    assert results.git_commit(tmp_path) == commit + "-dirty"
