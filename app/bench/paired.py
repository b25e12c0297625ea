"""A/B runs taken seconds apart. On a shared VM the machine's speed drifts within a minute
(docs/tuning.md), so two figures measured a minute apart compare badly. Here the two sides run in
turns, the order switching each round, and the summary is the median of the pairs' ratios.

`EngineWorker` is the usual B side: the engine alone, an `LLMEngine` as `localbatch bench` builds
it, in a process of its own (`python -m app.bench.worker`) that stays loaded between turns and is
stopped (SIGSTOP) while the other side takes its turn, so neither runs beside the other."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.bench.stats import median

T = TypeVar("T")


def alternate(a: Callable[[], T], b: Callable[[], T], rounds: int,
              on_pair: Callable[[int, T, T], None] | None = None) -> list[tuple[T, T]]:
    """`rounds` pairs (a's result, b's result); round 0 runs `a` first, round 1 `b` first, ..."""
    pairs = []
    for r in range(rounds):
        if r % 2:
            rb = b()
            ra = a()
        else:
            ra = a()
            rb = b()
        pairs.append((ra, rb))
        if on_pair is not None:
            on_pair(r, ra, rb)
    return pairs


@dataclass
class Turn:
    """One side's run: its tok/s, the engine's step split over it, a note, anything else it measured."""

    tok_s: float
    split: dict[str, float]  # step_ms, step_gap_us
    note: str = ""
    result: dict = field(default_factory=dict)


@dataclass
class Pair:
    target: Turn
    engine: Turn

    @property
    def ratio(self) -> float:
        return self.target.tok_s / self.engine.tok_s if self.engine.tok_s else float("nan")


def turns(target: Callable[[], Turn], engine: Callable[[], Turn], rounds: int, label: str) -> list[Pair]:
    """`rounds` pairs of the target and the engine alone (the engine first in round 0); prints each."""
    def show(r: int, e: Turn, t: Turn) -> None:
        print(f"{label}, round {r}: {t.tok_s:.1f} tok/s ({_split(t)}; {t.note}), engine alone {e.tok_s:.1f} "
              f"({_split(e)}): {t.tok_s / e.tok_s if e.tok_s else float('nan'):.3f}", flush=True)

    return [Pair(t, e) for e, t in alternate(engine, target, rounds, show)]


def _split(t: Turn) -> str:
    return f"step {t.split.get('step_ms', float('nan')):.2f} ms, {t.split.get('step_gap_us', float('nan')):.0f} us between"


def split_note(pairs: list[Pair]) -> str:
    """Both sides' median step and time between steps."""
    def med(side: str, key: str) -> float:
        return median(getattr(p, side).split.get(key, float("nan")) for p in pairs)
    return (f"steps {med('target', 'step_ms'):.2f} against the engine's {med('engine', 'step_ms'):.2f} ms, between "
            f"steps {med('target', 'step_gap_us'):.0f} against {med('engine', 'step_gap_us'):.0f} us")


def summary_row(where: str, pairs: list[Pair], note: str = "") -> dict:
    """One table row: medians of both sides' tok/s and of the pairs' ratios."""
    ratios = [p.ratio for p in pairs]
    return {"where": where, "tok_s": round(median(p.target.tok_s for p in pairs), 1),
            "engine_tok_s": round(median(p.engine.tok_s for p in pairs), 1), "ratio": round(median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "note": "; ".join(x for x in (note, split_note(pairs)) if x)}


def format_rows(rows: list[dict]) -> str:
    lines = ["| where | tok/s | engine alone | ratio (median of pairs) | notes |", "|---|---|---|---|---|"]
    for r in rows:
        engine = "-" if r.get("engine_tok_s") is None else f"{r['engine_tok_s']:.1f}"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        ratios = f"; ratios {', '.join(f'{x:.2f}' for x in r['ratios'])}" if r.get("ratios") else ""
        lines.append(f"| {r['where']} | {r['tok_s']:.1f} | {engine} | {ratio} | {r['note']}{ratios} |")
    return "\n".join(lines)


class EngineWorker:
    """The engine alone in its own process (`python -m app.bench.worker`), loaded once from `engine`
    (LLMEngine's keyword arguments, as the command line's `engine_kwargs` gives them). Each `run(n)`
    decodes n requests at concurrency n: `chat_prompt` as one user message each (the app's tabs'
    request, through the chat template), else `prompt_len` random token ids, new each run. It
    returns the worker's figures: decode_tok_s, output_tok_s, step_ms, step_gap_us."""

    def __init__(self, engine: dict[str, Any], max_tokens: int, prompt_len: int = 64,
                 chat_prompt: str | None = None) -> None:
        cmd = [sys.executable, "-m", "app.bench.worker", "--engine", json.dumps(engine, default=dataclasses.asdict),
               "--max-tokens", str(max_tokens), "--prompt-len", str(prompt_len),
               *(["--chat-prompt", chat_prompt] if chat_prompt else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL)
        self._read()  # loaded
        self._seed = 1000

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"the engine worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, n: int) -> dict:
        assert self.proc.stdin is not None
        self._seed += 1
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(f"{n} {self._seed}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.proc.send_signal(signal.SIGSTOP)
        return out

    def turn(self, n: int, key: str) -> Callable[[], Turn]:
        """A turn of n requests whose tok/s is the worker's `key` (decode_tok_s or output_tok_s)."""
        def run() -> Turn:
            out = self.run(n)
            return Turn(out[key], out)
        return run

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> EngineWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
