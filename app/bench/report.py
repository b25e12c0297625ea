"""`localbatch bench report RECORD...`: the tables of docs/benchmarks.md, regenerated from the
`--json` records. Each record becomes a heading that says what was measured where (the benchmark,
the commit, the CPU and its flags, the date), its settings that differ from the defaults' empty
values, its top-level figures, and one Markdown table per list of rows it holds."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.engine.types.errors import LocalbatchError

_OWN = ("benchmark", "environment", "settings")


def load(path: Path) -> dict[str, Any]:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LocalbatchError(f"{path}: not a benchmark record ({e})") from None
    if not isinstance(rec, dict) or not all(k in rec for k in _OWN):
        raise LocalbatchError(f"{path}: not a benchmark record (written with --json, it has "
                              "'benchmark', 'environment' and 'settings')")
    return rec


def heading(rec: dict[str, Any]) -> str:
    env = rec["environment"]
    flags = ", ".join(env.get("cpu_flags") or []) or "none of the listed flags"
    cores = f", {env['cpu_count']} cores" if env.get("cpu_count") else ""
    date = (env.get("time") or "")[:10] or "date unknown"
    return (f"### {rec['benchmark']}: commit {env.get('commit') or 'unknown'}, {env.get('cpu') or 'unknown CPU'} "
            f"({flags}{cores}), {date}")


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    if isinstance(value, dict):
        return "; ".join(f"{k} {cell(v)}" for k, v in value.items())
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _is_rows(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def section(rec: dict[str, Any]) -> str:
    parts = [heading(rec)]
    settings = {k: v for k, v in rec["settings"].items() if v not in (None, False, "") and k != "json"}
    if settings:
        parts.append("Settings: " + ", ".join(f"`{k}={cell(v)}`" for k, v in settings.items()))
    results = {k: v for k, v in rec.items() if k not in _OWN}
    figures = {k: v for k, v in results.items() if not _is_rows(v) and not isinstance(v, dict)}
    if figures:
        parts.append("Figures: " + ", ".join(f"{k} {cell(v)}" for k, v in figures.items()))
    parts += [f"{key}:\n\n{table(value)}" for key, value in results.items() if _is_rows(value)]
    return "\n\n".join(parts)


def report(paths: Iterable[Path]) -> str:
    """The records at `paths` as Markdown, one section each, in the order given."""
    return "\n\n".join(section(load(p)) for p in paths) + "\n"
