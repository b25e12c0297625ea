"""Tool calls on the benchmark's own tasks: how often a model's calls parse and validate, and how
often it gets the task right, with the call constraint on and off, and against an
OpenAI-compatible server.

    localbatch bench research tools --model qwen2.5-coder-0.5b-instruct [--modes on,off]
        [--tasks all|first:N|ID,KIND,...] [--max-tokens 256] [--steps 8] [--json PATH]
    localbatch bench research tools --url http://127.0.0.1:8080 [--url-model NAME]

The tasks (tasks.toml) ask about, fix or edit a small repository (fixture_repo/); each runs from
a fresh copy of it, with the built-in code tools (`localbatch mcp`, started through the app's
`ToolManager`) over that copy, every call approved, greedy decoding, `--max-tokens` per turn and
the step limit `--steps`. Modes: `on` is the app's turn (`tool_request`: the tools in the chat
template and the structural tag that makes a call name an offered tool with arguments valid for
its schema); `off` the same prompt decoded freely and parsed after; `url` the server's own
`tools` handling (llama-server `--jinja`: its template and its parser). Within each task the
modes run back to back, their order alternating. Per model and mode it reports task success,
the valid-call rate (every call written, parsed or not, checked against the offered tools'
schemas; a call the per-turn token cap cut before it closed is counted apart), turns, prompt
and output tokens and wall time per task."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from app.tools.config import ToolsConfig
from app.tools.manager import ServerState, ToolManager

from .runner import EngineAgent, OpenAIAgent, TaskRun, run_task, summarize
from .tasks import copy_fixture, load_tasks, select

TOOLS_START_TIMEOUT_S = 60.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="catalog names or GGUF files, comma-separated, run in-process one after another")
    p.add_argument("--modes", default="on,off",
                   help="in-process modes: on (constrained calls), off (free), first (on, the first turn must call)")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server to run the tasks against too")
    p.add_argument("--url-model", default=None, help="the model name sent to --url (default: its first)")
    p.add_argument("--tasks", default="all", help="all, first:N, or comma-separated task ids and kinds")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per model turn")
    p.add_argument("--steps", type=int, default=8, help="the step limit: rounds of calls per task")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no task after this many seconds (per model); the record says which were left")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(measure(args))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    tasks = select(load_tasks(), args.tasks)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in ("on", "off", "first")]:
        raise SystemExit(f"--modes: unknown mode {bad[0]!r} (on, off, first)")
    if not args.model and not args.url:
        raise SystemExit("give --model, --url or both")
    runs: list[TaskRun] = []
    with tempfile.TemporaryDirectory(prefix="localbatch-toolbench-") as tmp:
        root = Path(tmp) / "repo"
        copy_fixture(root)
        manager = start_tools(root)
        try:
            offered = [t.openai() for t in manager.offered_tools()]
            for model in [m.strip() for m in (args.model or "").split(",") if m.strip()]:
                runs += await run_engine(model, modes, tasks, manager, offered, root, args)
            if args.url:
                runs += await run_url(tasks, manager, offered, root, args)
        finally:
            manager.close()
    summary = summarize(runs)
    print_summary(summary)
    constrained = [r for r in summary if r["mode"] in ("on", "first")]
    ran = {r.task for r in runs}
    return {"summary": summary, "not_run": [t.id for t in tasks if t.id not in ran], "runs": [r.row() for r in runs],
            "ok": all(r["valid_call_pct"] in (100.0, None) for r in constrained)}


def start_tools(root: Path) -> ToolManager:
    """The built-in code tools over `root`, as the app starts them (`localbatch mcp`)."""
    manager = ToolManager(ToolsConfig(), workdir=root)
    manager.start()
    manager.wait_settled(TOOLS_START_TIMEOUT_S)
    status = manager.servers()[0]
    if status.state is not ServerState.READY:
        manager.close()
        raise SystemExit(f"the built-in tools did not start: {status.line()}")
    return manager


async def run_engine(model: str, modes: list[str], tasks: list, manager: ToolManager,
                     offered: list[dict[str, Any]], root: Path, args: argparse.Namespace) -> list[TaskRun]:
    from app.engine.api.async_engine import AsyncEngine

    print(f"loading {model} ...", flush=True)
    engine = await asyncio.to_thread(lambda: AsyncEngine(model, device=args.device, adaptive_threads=True))
    agents = {m: EngineAgent(engine, m != "off", args.max_tokens, m == "first") for m in modes}
    runs = []
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    try:
        for i, task in enumerate(tasks):
            if deadline is not None and time.monotonic() > deadline:
                print(f"time budget spent: {len(tasks) - i} task(s) not run", flush=True)
                break
            order = modes if i % 2 == 0 else modes[::-1]
            for mode in order:
                runs.append(await run_task(agents[mode], task, manager, offered, root, args.steps))
                print_run(runs[-1])
    finally:
        await engine.aclose()
    return runs


async def run_url(tasks: list, manager: ToolManager, offered: list[dict[str, Any]], root: Path,
                  args: argparse.Namespace) -> list[TaskRun]:
    agent = OpenAIAgent(args.url, args.max_tokens, args.url_model)
    await agent.resolve_model()
    runs = []
    try:
        for task in tasks:
            runs.append(await run_task(agent, task, manager, offered, root, args.steps))
            print_run(runs[-1])
    finally:
        await agent.aclose()
    return runs


def print_run(r: TaskRun) -> None:
    mark = "ok  " if r.ok else "FAIL"
    print(f"{mark} {r.model[:28]:28s} {r.mode:3s} {r.task:28s} turns {r.turns} calls {r.valid_calls}/{r.calls}"
          + (f" ({r.cut_calls} cut)" if r.cut_calls else "") + f" "
          f"tokens {r.prompt_tokens}+{r.output_tokens} {r.wall_s:6.1f} s  {r.why}"
          + ("" if r.ok or not r.answer else f"  [{r.answer[:100]!r}]"), flush=True)


def print_summary(rows: list[dict[str, Any]]) -> None:
    print()
    for r in rows:
        print(f"{r['model']} {r['mode']}: success {r['success_pct']}% of {r['tasks']} (answers "
              f"{r['answer_success_pct']}%, edits {r['edit_success_pct']}%), valid calls {r['valid_call_pct']}% "
              f"of {r['calls'] - r['cut_calls']} finished ({r['invalid_calls']} invalid, {r['cut_calls']} cut by the "
              f"token cap), {r['turns_mean']} turns, {r['prompt_tokens_mean']}+{r['output_tokens_mean']} "
              f"tokens, {r['wall_s_mean']} s per task", flush=True)
