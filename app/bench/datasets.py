"""The workloads: synthetic requests of random token ids (seeded, so both sides of a comparison get
the same ones), the one chat question the app's tabs are asked, and code-completion requests cut
from Python sources (fill-in-the-middle at a cursor, and follow-ups after small edits near it, as
an editor sends them)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # app/: Python sources every install has
# What the app's tabs are asked (and the chat workload of `bench serve --endpoint chat`): a reply
# long enough to time, the same for every tab.
CHAT_PROMPT = "Write a very long story about a lighthouse keeper who collects clocks, chapter by chapter."


@dataclass(frozen=True)
class Shape:
    """Prompt and output lengths: `*_len` is the mean, lengths uniform in [len*(1-r), len*(1+r)]
    (vLLM's random-range-ratio), or `*_range` "MIN,MAX"."""

    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    input_range: str | None = None
    output_range: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        return cls(args.input_len, args.output_len, getattr(args, "range_ratio", 0.0),
                   getattr(args, "input_range", None), getattr(args, "output_range", None))


def lengths(rng: random.Random, n: int, mean: int, ratio: float, span: str | None) -> list[int]:
    lo, hi = (int(v) for v in span.split(",")) if span else (max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio)))
    return [rng.randint(lo, max(lo, hi)) for _ in range(n)]


def make_requests(shape: Shape, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """`n` (prompt token ids, output tokens) pairs; the same for the same seed."""
    rng = random.Random(seed)
    ins = lengths(rng, n, shape.input_len, shape.range_ratio, shape.input_range)
    outs = lengths(rng, n, shape.output_len, shape.range_ratio, shape.output_range)
    return [([rng.randrange(vocab) for _ in range(i)], o) for i, o in zip(ins, outs)]


def random_prompt(rng: random.Random, length: int, max_id: int) -> list[int]:
    """Token ids for an HTTP prompt, from the upper half of [0, max_id): ordinary vocabulary,
    away from the special tokens most tokenizers put first."""
    return [rng.randrange(max_id // 2, max_id) for _ in range(length)]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def fim_cut_points(n: int, root: Path = PACKAGE, seed: int = 0) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs: a cursor at the start of a non-blank line of one of `root`'s larger
    Python files, 30 lines before it, 10 after; the line's indent ends the prefix."""
    rng = random.Random(seed)
    files = sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4000)
    if not files:
        raise ValueError(f"no Python file over 4 kB under {root}")
    out: list[tuple[str, str]] = []
    while len(out) < n:
        lines = _lines(rng.choice(files))
        if len(lines) < 41:
            continue
        i = rng.randrange(30, len(lines) - 10)
        if lines[i].strip():
            out.append(("".join(lines[i - 30:i]) + _indent(lines[i]), "".join(lines[i + 1:i + 11])))
    return out


@dataclass(frozen=True)
class FollowUps:
    """One file edited near the cursor between requests (a comment line typed just above it, one
    more each time), with an extra chunk of another file as an editor's context."""

    file: Path = PACKAGE / "cli.py"
    cursor_line: int = 170
    prefix_lines: int = 120
    suffix_lines: int = 40
    extra_file: Path | None = PACKAGE / "bench" / "throughput.py"
    extra_lines: int = 60

    def requests(self, count: int) -> list[dict]:
        """`count` llama.cpp `/infill` bodies (input_prefix, input_suffix, input_extra)."""
        lines = _lines(self.file)
        cursor = max(1, min(self.cursor_line, len(lines) - 1))
        indent = _indent(lines[cursor])
        prefix = "".join(lines[max(0, cursor - self.prefix_lines):cursor])
        suffix = "".join(lines[cursor:cursor + self.suffix_lines])
        extra = []
        if self.extra_file is not None:
            extra = [{"filename": self.extra_file.name, "text": "".join(_lines(self.extra_file)[:self.extra_lines])}]
        bodies = []
        for k in range(count):
            typed = "".join(f"{indent}# step {j}\n" for j in range(k))
            bodies.append({"input_extra": extra, "input_prefix": prefix + typed + indent, "input_suffix": suffix})
        return bodies
