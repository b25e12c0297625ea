"""The tool benchmark (benchmarks/tools): its task set loads, every checker accepts a correct run
and rejects a wrong one, and the runner takes a task through the built-in tools with a scripted
fake engine, in-process (constraint on and off) and over HTTP. No real model runs here."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json

import pytest

from app.bench import report, research
from app.bench.results import record
from app.engine.api.tool_use import ParsedCall
from app.testing.fake_engine import FakeEngine, ServerThread
from app.tools.workdir import Workdir

# The checkout's scripts, found as `localbatch bench research tools` finds them.
tools_bench = research.load("tools")
runner = importlib.import_module("benchmarks.tools.runner")
tasks_mod = importlib.import_module("benchmarks.tools.tasks")

TASKS = tasks_mod.load_tasks()


def test_the_task_set_loads():
    assert len(TASKS) >= 30
    assert len({t.id for t in TASKS}) == len(TASKS)
    kinds = {t.kind for t in TASKS}
    assert {"find", "count", "value", "returns", "fix", "edit"} <= kinds
    assert all(t.reference if not t.edits else t.reference_edit for t in TASKS)
    assert tasks_mod.select(TASKS, "first:3") == TASKS[:3]
    assert [t.id for t in tasks_mod.select(TASKS, "fix")] == [t.id for t in TASKS if t.kind == "fix"]
    with pytest.raises(ValueError, match="no task or kind named nope"):
        tasks_mod.select(TASKS, "nope")


def _correct_run(task, root):
    tasks_mod.copy_fixture(root)
    if task.edits:
        Workdir.open(root).apply_edit(task.path, task.reference_edit["search"], task.reference_edit["replace"])
        return ""
    return task.reference


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.id)
def test_each_checker_accepts_a_correct_run_and_rejects_a_wrong_one(task, tmp_path):
    root = tmp_path / "repo"
    verdict = tasks_mod.check(task, _correct_run(task, root), root)
    assert verdict.ok, verdict.why
    tasks_mod.copy_fixture(root)
    if task.edits:  # wrong: nothing changed, then the right change beside a stray one
        assert not tasks_mod.check(task, "Done.", root).ok
        _correct_run(task, root)
        (root / "README.md").write_text("changed\n")
        assert "other files changed: README.md" in tasks_mod.check(task, "Done.", root).why
    else:
        assert not tasks_mod.check(task, "I could not find that in the repository.", root).ok


def test_an_edit_that_breaks_the_file_is_rejected(tmp_path):
    task = next(t for t in TASKS if t.id == "fix-is_leap_year")
    tasks_mod.copy_fixture(tmp_path)
    Workdir.open(tmp_path).apply_edit(task.path, "    return year % 4 == 0\n", "    return year % 4 = 0\n")
    assert "the check failed" in tasks_mod.check(task, "", tmp_path).why


def test_calls_are_checked_against_the_offered_schemas():
    schemas = {"files__read_file": {"type": "object", "properties": {"path": {"type": "string"}},
                                    "required": ["path"]}}
    assert runner.call_problem(ParsedCall("1", "files__read_file", '{"path": "a.py"}'), schemas) is None
    assert "no tool" in runner.call_problem(ParsedCall("1", "read_file", '{"path": "a.py"}'), schemas)
    assert "not JSON" in runner.call_problem(ParsedCall("1", "files__read_file", '{"path": '), schemas)
    assert "schema" in runner.call_problem(ParsedCall("1", "files__read_file", '{"file": "a.py"}'), schemas)
    assert runner.unparsed_calls('<tool_call>{"name": oops</tool_call>') == 1
    assert runner.unparsed_calls('```json\n{"name": "shipping_cost", "arguments": {}}\n```') == 1
    assert runner.unparsed_calls("The answer is 4.99.") == 0


# --- the runner, with a scripted fake engine and the real built-in tools ----------------------------


def _script(call: dict, answer: str):
    """First turn: `call`; once a result came back: `answer`."""
    def script(prompt):
        answered = any("<tool_response>" in str(m.get("content")) for m in prompt
                       if isinstance(m, dict) and m.get("role") == "user")
        if answered:
            return [answer]
        return ["<tool_call>", json.dumps(call), "</tool_call>"]
    return script


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    root = tmp_path_factory.mktemp("toolbench") / "repo"
    tasks_mod.copy_fixture(root)
    manager = tools_bench.start_tools(root)
    yield manager, [t.openai() for t in manager.offered_tools()], root
    manager.close()


def _run(agent, task, tools, steps=8):
    manager, offered, root = tools
    return asyncio.run(runner.run_task(agent, task, manager, offered, root, steps))


@pytest.mark.parametrize("constrained", [True, False])
def test_the_runner_completes_an_answer_task(tools, constrained):
    task = next(t for t in TASKS if t.id == "define-slugify")
    engine = FakeEngine(step_delay=0, max_model_len=8192,
                        script=_script({"name": "files__search", "arguments": {"pattern": "def slugify"}},
                                       "It is defined in shop/textutil.py."))
    run = _run(runner.EngineAgent(engine, constrained, 256), task, tools)
    assert run.ok, run.why
    assert (run.mode, run.turns, run.calls, run.valid_calls) == ("on" if constrained else "off", 2, 1, 1)
    assert run.prompt_tokens > 0 and run.output_tokens > 0 and run.wall_s > 0
    params = [s.params for s in engine.submitted]
    assert all((p.structural_tag is not None) == constrained for p in params)


def test_the_first_mode_makes_the_first_turn_call_a_tool(tools):
    task = next(t for t in TASKS if t.id == "define-slugify")
    engine = FakeEngine(step_delay=0, max_model_len=8192, script=lambda prompt: ["It is in shop/textutil.py."])
    run = _run(runner.EngineAgent(engine, True, 256, first_required=True), task, tools)
    assert run.ok, run.why
    # The fake's forced call (the first tool, its schema's example arguments) fails, so the next
    # turn must call too (`next_tool_choice`); the third answers.
    assert (run.mode, run.turns) == ("first", 3) and run.calls >= 2 and run.valid_calls == run.calls


def test_the_runner_applies_an_edit_and_counts_a_bad_call(tools):
    task = next(t for t in TASKS if t.id == "set-TAX_RATE")
    engine = FakeEngine(step_delay=0, max_model_len=8192,
                        script=_script({"name": "files__apply_edit", "arguments": {"path": task.path,
                                                                                   **task.reference_edit}}, "Done."))
    run = _run(runner.EngineAgent(engine, True, 256), task, tools)
    assert run.ok and run.valid_calls == run.calls == 1
    bad = FakeEngine(step_delay=0, max_model_len=8192,
                     script=_script({"name": "files__apply_edit", "arguments": {"file": task.path}}, "Done."))
    run = _run(runner.EngineAgent(bad, False, 256), task, tools)
    assert not run.ok and (run.calls, run.valid_calls) == (1, 0)
    assert "unchanged" in run.why and "schema" in run.problems[0]


@pytest.mark.parametrize("pieces", [
    ["<tool_call>", '\n{"name": "files__read_file", ', '"arguments": {"path": ', '"shop/', 'dates.py"}}\n</tool_call>'],
    ['{"name": "files__read_file", ', '"arguments": {"path": ', '"shop/', 'dates.py"}}'],
], ids=["tagged", "bare"])
def test_a_call_cut_by_the_token_cap_counts_as_cut_not_invalid(tools, pieces):
    task = next(t for t in TASKS if t.id == "define-days_in_month")
    engine = FakeEngine(step_delay=0, max_model_len=8192, script=lambda prompt: list(pieces))
    run = _run(runner.EngineAgent(engine, False, 3), task, tools, steps=1)
    assert run.calls >= 1 and (run.valid_calls, run.cut_calls) == (0, run.calls)
    assert all("cut by the token cap" in p for p in run.problems)
    row = runner.summarize([run])[0]
    assert (row["valid_call_pct"], row["cut_calls"], row["invalid_calls"]) == (None, run.calls, 0)


def test_an_invalid_call_in_a_finished_turn_is_not_cut(tools):
    task = next(t for t in TASKS if t.id == "define-days_in_month")
    engine = FakeEngine(step_delay=0, max_model_len=8192,
                        script=lambda prompt: ["<tool_call>", '\n{"name": "read", "arguments": {}}\n</tool_call>'])
    run = _run(runner.EngineAgent(engine, False, 256), task, tools, steps=1)
    assert run.cut_calls == 0 and run.valid_calls == 0 and run.calls >= 1
    assert all("cut" not in p for p in run.problems)
    assert runner.summarize([run])[0]["invalid_calls"] == run.calls


def test_the_step_limit_ends_a_runaway_task(tools):
    task = next(t for t in TASKS if t.id == "define-slugify")
    loop_forever = FakeEngine(step_delay=0, max_model_len=16384,
                              script=lambda prompt: ["<tool_call>", '{"name": "files__list_files", "arguments": {}}',
                                                     "</tool_call>"])
    run = _run(runner.EngineAgent(loop_forever, True, 256), task, tools, steps=2)
    assert (run.stopped, run.turns, run.ok) == ("step limit", 3, False)


def test_the_url_mode_reads_an_openai_servers_tool_calls(tools):
    task = next(t for t in TASKS if t.id == "value-MAX_STOCK")
    engine = FakeEngine(step_delay=0, max_model_len=8192,
                        script=_script({"name": "files__read_file", "arguments": {"path": "shop/inventory.py"}},
                                       "MAX_STOCK is 500."))

    async def go(url):
        agent = runner.OpenAIAgent(url, 256)
        await agent.resolve_model()
        manager, offered, root = tools
        try:
            return await runner.run_task(agent, task, manager, offered, root, 8)
        finally:
            await agent.aclose()

    with ServerThread(engine) as server:
        run = asyncio.run(go(server.url))
    assert run.ok, run.why
    assert (run.mode, run.model, run.turns, run.valid_calls) == ("url", "fake-model", 2, 1)


def test_the_record_becomes_a_table():
    runs = [runner.TaskRun("m", "on", "a", "find", True, "", turns=2, calls=1, valid_calls=1),
            runner.TaskRun("m", "off", "a", "fix", False, "unchanged", turns=1, calls=1)]
    summary = runner.summarize(runs)
    assert [(r["mode"], r["success_pct"], r["valid_call_pct"]) for r in summary] == [("on", 100.0, 100.0),
                                                                                     ("off", 0.0, 0.0)]
    args = argparse.Namespace(model="m", tasks="all", max_tokens=256, steps=8)
    text = report.section(record("tools", vars(args), {"summary": summary, "runs": [r.row() for r in runs]}))
    assert "| model | mode | tasks | success_pct |" in text and "| m | off | 1 | 0 |" in text
