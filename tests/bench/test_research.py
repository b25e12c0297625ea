"""The research benchmarks' registry: every script under benchmarks/ is registered, answers its
question, takes its options through one parser with --json, and its results reach the shared
record. The measurements themselves are not run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bench import research
from app.engine.types.errors import LocalbatchError

ROOT = Path(__file__).resolve().parents[2]
HELPERS = {"benchmarks/ui/tmux.py", "benchmarks/engine_options.py", "benchmarks/tools/tasks.py",
           "benchmarks/tools/runner.py"}
FIXTURES = "benchmarks/tools/fixture_repo/"  # the tool benchmark's small repository, not scripts


def scripts() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")
            if p.name != "__init__.py" and not str(p.relative_to(ROOT)).startswith(FIXTURES)} - HELPERS


def test_every_script_is_registered_once():
    registered = [r.module.replace(".", "/") + ".py" for r in research.RESEARCH.values()]
    assert sorted(registered) == sorted(scripts())
    assert all(name == Path(path).stem for name, path in zip(research.RESEARCH, registered))
    assert all(r.question.endswith("?") or r.question.endswith("(CUDA)") for r in research.RESEARCH.values())


@pytest.mark.parametrize("name", list(research.RESEARCH))
def test_each_script_writes_the_record(name, tmp_path, monkeypatch, capsys):
    module = research.load(name)
    assert not hasattr(module, "main"), "one entry: localbatch bench research"
    monkeypatch.setattr(module, "run", lambda args: print("report") or {"rows": [{"x": 1}], "figure": 2.5})
    out = tmp_path / "r.json"
    assert research.run_research(name, ["--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == name and rec["rows"] == [{"x": 1}] and rec["figure"] == 2.5
    assert {"commit", "cpu", "cpu_flags", "time"} <= rec["environment"].keys()
    assert rec["settings"]["json"] == str(out)
    assert "report" in capsys.readouterr().out


def test_json_on_stdout_moves_the_text_report_to_stderr(monkeypatch, capsys):
    module = research.load("long_context")
    monkeypatch.setattr(module, "run", lambda args: print("text") or {"rows": []})
    assert research.run_research("long_context", ["--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["benchmark"] == "long_context" and "text" in err


def test_a_failed_check_is_exit_status_1(monkeypatch):
    module = research.load("soak")
    monkeypatch.setattr(module, "run", lambda args: {"ok": False})
    assert research.run_research("soak", []) == 1


def test_the_command_line_runs_a_registered_entry(monkeypatch, tmp_path):
    from app.cli import main

    module = research.load("window_cap")
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(args.lengths) or {})
    assert main(["bench", "research", "window_cap", "--lengths", "64", "--json", str(tmp_path / "w.json")]) == 0
    assert seen == ["64"] and (tmp_path / "w.json").is_file()


def test_without_a_checkout_the_message_says_so(monkeypatch):
    monkeypatch.setitem(research.RESEARCH, "gone", research.Research("benchmarks.nowhere.gone", "?"))
    with pytest.raises(LocalbatchError, match="source checkout"):
        research.load("gone")


def test_the_engine_worker_does_not_import_the_command_line():
    """app.cli imports app.bench; app.bench takes the engine's settings from it as arguments."""
    import ast

    for path in (ROOT / "app" / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "app.cli", path
            elif isinstance(node, ast.Import):
                assert all(a.name != "app.cli" for a in node.names), path


def test_long_contexts_floor_is_the_steps_bytes_over_the_rate_they_are_read_at(tiny_gguf_factory):
    from app.engine.core.llm_engine import LLMEngine

    module = research.load("long_context")
    engine = LLMEngine(str(tiny_gguf_factory("llama")), device="cpu", dtype="float32")
    traffic = engine.metrics.traffic
    short, long = module.step_floor(engine, 8), module.step_floor(engine, 200)
    assert short[0] == traffic.weight_bytes_per_step(1) + traffic.kv_bytes_read([8])
    assert long[0] - short[0] == traffic.kv_bytes_read([200]) - traffic.kv_bytes_read([8]) > 0
    assert short[1] > 0 and long[1] > 0
