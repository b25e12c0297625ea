"""The tool benchmark's tasks (tasks.toml) over its fixture repository (fixture_repo/), and their
checkers: an answer task passes on the final reply's text, an edit task on the files the run
left in its copy of the fixture."""

from __future__ import annotations

import re
from itertools import zip_longest
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixture_repo"
TASKS_FILE = HERE / "tasks.toml"
CHECK_TIMEOUT_S = 30
_SKIP = ("__pycache__",)


@dataclass(frozen=True)
class Task:
    id: str
    kind: str  # find, count, value, returns (answers); fix, edit (files)
    prompt: str
    answer: tuple[str, ...] = ()  # regexes the reply must all match (case-insensitive)
    wrong: tuple[str, ...] = ()  # regexes it must not match
    path: str | None = None  # the file an edit task changes
    check: str | None = None  # Python run in the copy: exit 0 means fixed
    expect_replace: tuple[tuple[str, str], ...] = ()  # the expected file: the fixture's with these applied
    reference: str | None = None  # a correct reply
    reference_edit: dict[str, str] = field(default_factory=dict)  # a correct apply_edit's arguments

    @property
    def edits(self) -> bool:
        return self.path is not None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""


def load_tasks(path: Path = TASKS_FILE) -> list[Task]:
    data = tomllib.loads(path.read_text())
    tasks = []
    for raw in data["task"]:
        raw = dict(raw)
        for key in ("answer", "wrong"):
            raw[key] = tuple(raw.get(key, ()))
        raw["expect_replace"] = tuple(tuple(pair) for pair in raw.get("expect_replace", ()))
        tasks.append(Task(**raw))
    _validate(tasks)
    return tasks


def _validate(tasks: list[Task]) -> None:
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{TASKS_FILE.name}: task ids repeat")
    for t in tasks:
        if t.edits == bool(t.answer):
            raise ValueError(f"task {t.id}: give either answer regexes or an edited path")
        if t.edits and not (t.check or t.expect_replace):
            raise ValueError(f"task {t.id}: an edit task needs check or expect_replace")
        for pattern in (*t.answer, *t.wrong):
            re.compile(pattern)


def select(tasks: list[Task], spec: str | None) -> list[Task]:
    """`spec`: comma-separated task ids and kinds (in that order), `first:N`, or `mixed` (every task,
    the kinds taken in turn: a run cut short still has some of each); None or "all": every task."""
    if not spec or spec == "all":
        return tasks
    if spec == "mixed":
        kinds = [[t for t in tasks if t.kind == k] for k in dict.fromkeys(t.kind for t in tasks)]
        return [t for row in zip_longest(*kinds) for t in row if t is not None]
    if spec.startswith("first:"):
        return tasks[:int(spec.split(":", 1)[1])]
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [w for w in wanted if not any(w in (t.id, t.kind) for t in tasks)]
    if unknown:
        raise ValueError(f"no task or kind named {', '.join(unknown)}")
    return list({t.id: t for w in wanted for t in tasks if w in (t.id, t.kind)}.values())


def copy_fixture(dest: Path) -> None:
    """`dest` emptied and filled with a fresh copy of the fixture (the tool server keeps its root)."""
    dest.mkdir(parents=True, exist_ok=True)
    for child in dest.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.copytree(FIXTURE, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*_SKIP))


def fixture_files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text(errors="replace") for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part in _SKIP for part in p.parts)}


def expected_file(task: Task) -> str:
    assert task.path is not None
    text = (FIXTURE / task.path).read_text()
    for old, new in task.expect_replace:
        text = text.replace(old, new)
    return text


def _same_text(a: str, b: str) -> bool:
    """Equal apart from spaces at line ends and trailing blank lines."""
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]
    return norm(a) == norm(b)


def check(task: Task, reply: str, root: Path) -> Verdict:
    """Whether the run passed: its final reply `reply`, its copy of the fixture at `root`."""
    if not task.edits:
        return check_answer(task, reply)
    return check_files(task, root)


def check_answer(task: Task, reply: str) -> Verdict:
    missing = [p for p in task.answer if not re.search(p, reply, re.IGNORECASE)]
    if missing:
        return Verdict(False, f"the answer lacks {missing[0]!r}")
    wrong = [p for p in task.wrong if re.search(p, reply, re.IGNORECASE)]
    if wrong:
        return Verdict(False, f"the answer matches the wrong {wrong[0]!r}")
    return Verdict(True)


def check_files(task: Task, root: Path) -> Verdict:
    assert task.path is not None
    before, after = fixture_files(FIXTURE), fixture_files(root)
    others = sorted(k for k in before.keys() | after.keys()
                    if k != task.path and not _same_text(before.get(k, ""), after.get(k, "\0")))
    if others:
        return Verdict(False, f"other files changed: {', '.join(others)}")
    if task.path not in after:
        return Verdict(False, f"{task.path} is gone")
    if _same_text(after[task.path], before[task.path]):
        return Verdict(False, f"{task.path} is unchanged")
    if task.expect_replace and not _same_text(after[task.path], expected_file(task)):
        return Verdict(False, f"{task.path} differs from the expected file")
    if task.check:
        return _run_check(task.check, root)
    return Verdict(True)


def _run_check(code: str, root: Path) -> Verdict:
    try:
        done = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, '.')\n" + code],
                              cwd=root, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"the check took over {CHECK_TIMEOUT_S} s")
    if done.returncode == 0:
        return Verdict(True)
    last = (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]
    return Verdict(False, f"the check failed: {last[:200]}")
