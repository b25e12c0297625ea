"""Where code is defined, from its text alone: the lines that open a definition (a function, a
class, ...) in the common languages, the definition that holds a given line (as `git grep -p`
shows it), and a file's outline. No parser: indentation and a keyword at the line's start."""

from __future__ import annotations

import re

# A line that opens a definition: Python, JavaScript/TypeScript, Go, Rust, C-family types, shell.
DEFINITION = re.compile(
    r"^\s*(?:(?:export|pub(?:\([^)]*\))?|public|private|protected|static|async|unsafe|default)\s+)*"
    r"(?:(?:def|class|function|fn|func|struct|enum|interface|impl|trait|module|type)\s+[A-Za-z_$]|func\s*\(|impl\s*<)"
    r"|^\s*[A-Za-z_]\w*\s*\(\)\s*\{")
_NAME = re.compile(r"\b(?:def|class|function|fn|func|struct|enum|interface|trait|module|type)\s+([A-Za-z_$][\w$]*)")
OUTLINE_MAX = 200  # definitions an outline lists


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def enclosing(lines: list[str], i: int) -> int | None:
    """The index of the nearest definition line above line `i` that holds it (less indented than
    `i` and than every non-blank line between), or None at the top level."""
    limit = indent(lines[i]) if lines[i].strip() else None
    for j in range(i - 1, -1, -1):
        if not lines[j].strip():
            continue
        depth = indent(lines[j])
        if limit is not None and depth >= limit:
            continue
        if DEFINITION.match(lines[j]):
            return j
        limit = depth
        if depth == 0:
            return None
    return None


def outline(lines: list[str]) -> list[tuple[int, str]]:
    """(1-based line, text) of each definition line, at most `OUTLINE_MAX`."""
    return [(i + 1, line.rstrip()) for i, line in enumerate(lines) if DEFINITION.match(line)][:OUTLINE_MAX]


def defined_name(line: str) -> str | None:
    """The name a definition line defines (`def quarter(month):` -> "quarter"), else None."""
    if not DEFINITION.match(line):
        return None
    found = _NAME.search(line)
    return found.group(1) if found else None
