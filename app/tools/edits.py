"""Text edits as a model writes them: one search/replace, or a unified diff of one file; and the
diff of what changed, which is what the caller shows and the model reads back.

A diff's hunks are placed by their old lines (context and removals), searched near the line the
hunk names and then anywhere, since small models often get the numbers wrong."""

from __future__ import annotations

import difflib
import re

from app.tools.errors import ToolInputError

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def replace_once(text: str, search: str, replace: str, creating: bool = False) -> str:
    if creating:
        return replace
    if not search:
        raise ToolInputError("search is empty: give the exact text to replace")
    count = text.count(search)
    if count == 0:
        stripped = search.strip()
        hint = " (it does, apart from leading or trailing whitespace)" if stripped and stripped in text else ""
        raise ToolInputError(f"search text not found in the file{hint}; read the file and copy the text exactly")
    if count > 1:
        raise ToolInputError(f"search text occurs {count} times; include more surrounding lines so it is unique")
    return text.replace(search, replace, 1)


def unified_diff(path: str, before: str, after: str, creating: bool = False) -> str:
    old = "/dev/null" if creating else f"a/{path}"
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile=old, tofile=f"b/{path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def apply_unified_diff(text: str, diff: str) -> str:
    """`text` with the hunks of `diff` applied (headers are optional; one file only)."""
    hunks = _parse_hunks(diff)
    if not hunks:
        raise ToolInputError("the diff has no hunks (lines starting with @@)")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
        had_newline = False
    else:
        had_newline = True
    offset = 0
    for number, (start, old, new) in enumerate(hunks, 1):
        at = _locate(lines, old, max(0, start - 1 + offset))
        if at is None:
            raise ToolInputError(f"hunk {number} does not match the file; read the file and make the diff again")
        lines[at:at + len(old)] = new
        offset += len(new) - len(old)
    out = "".join(lines)
    return out if had_newline or not out.endswith("\n") else out[:-1]


def _parse_hunks(diff: str) -> list[tuple[int, list[str], list[str]]]:
    hunks: list[tuple[int, list[str], list[str]]] = []
    files = 0
    current: tuple[int, list[str], list[str]] | None = None
    for raw in diff.splitlines():
        if raw.startswith("--- "):
            files += 1
            if files > 1:
                raise ToolInputError("the diff changes more than one file; send one apply_edit per file")
            current = None
            continue
        if raw.startswith("+++ ") and current is None:
            continue
        match = _HUNK.match(raw)
        if match:
            current = (int(match.group(1)), [], [])
            hunks.append(current)
            continue
        if current is None or raw.startswith("\\"):
            continue
        kind, body = (raw[:1], raw[1:]) if raw else (" ", "")
        if kind not in " +-":
            raise ToolInputError(f"diff line {raw[:40]!r} starts with none of ' ', '+', '-'")
        if kind in " -":
            current[1].append(body + "\n")
        if kind in " +":
            current[2].append(body + "\n")
    return hunks


def _locate(lines: list[str], old: list[str], hint: int) -> int | None:
    """Where `old` occurs in `lines`, the occurrence nearest `hint`."""
    if not old:
        return min(hint, len(lines))
    n = len(old)
    found = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == old]
    if not found:
        stripped = [line.rstrip() for line in old]
        found = [i for i in range(len(lines) - n + 1) if [x.rstrip() for x in lines[i:i + n]] == stripped]
    return min(found, key=lambda i: abs(i - hint)) if found else None
