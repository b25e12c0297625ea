"""`localbatch bench tui --tabs 1,4,8`: does the terminal app slow its own engine?

One engine (`AsyncEngine`, its step thread, as `localbatch` runs it) serves both halves of each
run, so they differ only by the app: first N synthetic requests stream with no app (the `bench`
workload: random prompt ids, `ignore_eos`), then the real app (Textual, real rendering at a real
terminal size, headless driver) broadcasts one prompt to N tabs. Both read the engine's aggregate
decode tok/s while all N decode; the ratio app / no app is the figure (target >= 0.9). Also
measured: the UI thread's CPU share while the tabs stream, and the process's CPU while the app
sits idle. (Running the headless half on another thread would not do: a second thread computing
with torch leaves its OpenMP team behind and the step thread then ran slower: docs/tuning.md.)"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from app.bench.datasets import CHAT_PROMPT, Shape, make_requests
from app.engine.types.sampling_params import SamplingParams

TERMINAL_SIZE = (160, 48)
_SAMPLE_S = 0.2
_IDLE_S = 3.0


@dataclass(frozen=True)
class TuiRun:
    tabs: int
    app_decode_tok_s: float
    headless_decode_tok_s: float
    ui_thread_cpu: float  # fraction of one core the UI (main) thread used while the tabs streamed
    process_cpu: float  # the same for the whole process (engine and torch threads included)
    idle_cpu: float  # the whole process while the app shows finished replies, nothing running

    @property
    def ratio(self) -> float:
        return self.app_decode_tok_s / self.headless_decode_tok_s if self.headless_decode_tok_s else 0.0


class _BenchEngine:
    """The shared engine as the app sees it: every request ignores EOS, so each tab streams its
    full max_tokens as the headless requests do, and the app's quit does not close it."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, prompt: Any, params: SamplingParams, request_id: str | None = None, **kwargs: Any) -> Any:
        return self._engine.stream(prompt, replace(params, ignore_eos=True), request_id, **kwargs)

    async def aclose(self) -> None:
        """The app's quit leaves the shared engine running for the next run."""

    def close(self) -> None:
        """As `aclose`: `_run_all` closes the engine itself."""


def run_tui_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any],
                  progress: Callable[[str, float | None], None] | None = None) -> list[TuiRun]:
    return asyncio.run(_run_all([int(x) for x in args.tabs.split(",")], args, engine_kwargs, progress))


def tui_results(runs: list[TuiRun]) -> dict:
    return {"runs": [{**asdict(r), "ratio": round(r.ratio, 3)} for r in runs]}


async def _run_all(tab_counts: list[int], args: argparse.Namespace, engine_kwargs: dict[str, Any],
                   progress: Callable[[str, float | None], None] | None) -> list[TuiRun]:
    from app.engine.api.async_engine import AsyncEngine

    engine = await asyncio.to_thread(lambda: AsyncEngine(progress=progress, **engine_kwargs))
    try:
        await _headless(engine, 2, args)  # warm-up: first steps pay one-time costs
        runs = []
        for n in tab_counts:
            headless = await _headless(engine, n, args)
            runs.append(await _app_run(_BenchEngine(engine), n, args, headless))
        return runs
    finally:
        await engine.aclose()


async def _headless(engine: Any, n: int, args: argparse.Namespace) -> float:
    requests = make_requests(Shape(args.input_len, args.output_len), n, engine.engine.plan.model_config.vocab_size,
                             args.seed + n)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> None:
        async for _ in engine.stream(ids, params):
            pass

    tasks = [asyncio.create_task(one(ids)) for ids, _ in requests]
    rate, _, _ = await _measure_while_all_decode(engine, n, lambda: not all(t.done() for t in tasks))
    await asyncio.gather(*tasks)
    return rate


async def _app_run(engine: _BenchEngine, tabs: int, args: argparse.Namespace, headless: float) -> TuiRun:
    from app.ui.app import LocalbatchApp, TuiOptions

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(f"[sampling]\ntemperature = 0.0\nmax_tokens = {args.output_len}\n")
        app = LocalbatchApp(lambda *_: engine, TuiOptions(data_dir=Path(tmp) / "data", config_path=config))
        async with app.run_test(size=TERMINAL_SIZE) as pilot:
            rate, ui_cpu, cpu = await _stream_tabs(app, pilot, tabs)
            idle = await _idle_cpu(pilot)
            await pilot.press("ctrl+q")
    return TuiRun(tabs, rate, headless, ui_cpu, cpu, idle)


async def _stream_tabs(app: Any, pilot: Any, tabs: int) -> tuple[float, float, float]:
    from app.ui.screen import ChatScreen

    while not (isinstance(app.screen, ChatScreen) and app.screen.active_pane() is not None):
        await asyncio.sleep(0.1)
    await pilot.pause()
    screen = app.screen
    for _ in range(tabs - 1):
        await screen.new_tab()
    await pilot.pause()
    screen.active_pane().query_one("PromptInput").insert(CHAT_PROMPT)
    screen.action_command("broadcast")
    busy = lambda: any(p.generating for p in screen.panes())  # noqa: E731
    result = await _measure_while_all_decode(screen.engine, tabs, busy)
    while busy():
        await asyncio.sleep(_SAMPLE_S)
    return result


async def _measure_while_all_decode(engine: Any, n: int, busy: Callable[[], bool]) -> tuple[float, float, float]:
    """Decode tok/s (from the engine's token counter), the calling (UI) thread's and the process's
    CPU share, over the stretch where all `n` requests are decoding."""
    first = last = None
    while busy():
        stats = engine.stats()
        sample = (time.perf_counter(), stats.total_output_tokens, time.thread_time(), time.process_time())
        if stats.num_running == n and all(r.status == "decode" for r in stats.requests):
            first, last = first or sample, sample
        elif first is not None:
            break
        await asyncio.sleep(_SAMPLE_S)
    if first is None or last is first:
        return 0.0, 0.0, 0.0
    wall = last[0] - first[0]
    return (last[1] - first[1]) / wall, (last[2] - first[2]) / wall, (last[3] - first[3]) / wall


async def _idle_cpu(pilot: Any) -> float:
    await pilot.pause()
    await asyncio.sleep(2.5)  # let the rate window decay, as for a user reading the replies
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.sleep(_IDLE_S)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def format_tui_runs(runs: list[TuiRun]) -> str:
    lines = [f"{'tabs':>4}  {'app tok/s':>10}  {'no-app tok/s':>12}  {'ratio':>6}  "
             f"{'UI thread CPU':>13}  {'process CPU':>11}  {'idle CPU':>8}"]
    for r in runs:
        lines.append(f"{r.tabs:>4}  {r.app_decode_tok_s:>10.1f}  {r.headless_decode_tok_s:>12.1f}  {r.ratio:>6.2f}  "
                     f"{r.ui_thread_cpu:>13.0%}  {r.process_cpu:>11.0%}  {r.idle_cpu:>8.1%}")
    return "\n".join(lines)
