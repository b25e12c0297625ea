"""One working directory as a model may touch it: list, read, search and edit files inside it,
never outside. Every path a caller gives is relative to the root; it is refused when it is
absolute, holds a NUL, or resolves (through `..` or any symlink, the file's or a parent's) to a
place outside the root. Writes also refuse `.git/` and binary files.

Each function returns the text the model reads and raises `ToolInputError` (one line) for input
it cannot act on."""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.tools.edits import apply_unified_diff, replace_once, unified_diff
from app.tools.errors import ToolInputError
from app.tools.outline import defined_name, enclosing, outline

MAX_LIST = 1000  # files one listing may return
DEFAULT_LIST = 200
MAX_READ_LINES = 2000
MAX_READ_BYTES = 100_000  # of text returned by one read_file
MAX_FILE_BYTES = 4_000_000  # files larger than this are neither read, searched nor edited
MAX_MATCHES = 200
DEFAULT_MATCHES = 50
MAX_CONTEXT = 10
MAX_SEARCH_FILES = 20_000
MAX_LINE_CHARS = 400  # a search hit's line is cut here (minified files)
MAX_SUGGESTIONS = 3  # files a missing path's error names
# Skipped by the walk outside a git repository (a repository's own ignore rules say more).
WALK_SKIP = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".tox"})


@dataclass(frozen=True)
class Workdir:
    root: Path

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Workdir:
        path = Path(root).expanduser()
        if not path.is_dir():
            raise ToolInputError(f"{path} is not a directory")
        return cls(Path(os.path.realpath(path)))

    # --- paths ----------------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The real path of `path` (relative to the root), refused when it leaves the root."""
        if not isinstance(path, str) or not path.strip():
            raise ToolInputError("path is empty: give a path relative to the working directory")
        if "\x00" in path:
            raise ToolInputError("path contains a NUL character")
        if os.path.isabs(path) or path.startswith("~") or re.match(r"^[A-Za-z]:[\\/]", path):
            raise ToolInputError(f"{path!r} is absolute: give a path relative to the working directory")
        real = Path(os.path.realpath(self.root / path))
        if real != self.root and self.root not in real.parents:
            raise ToolInputError(f"{path!r} is outside the working directory")
        return real

    def relative(self, real: Path) -> str:
        return real.relative_to(self.root).as_posix() or "."

    # --- list_files -----------------------------------------------------------------------------

    def list_files(self, path: str = ".", pattern: str | None = None, limit: int = DEFAULT_LIST) -> str:
        """Files under `path` (not ignored by .gitignore), matching the glob `pattern`, at most
        `limit`, and how many; a file's `path`: its outline (a model lists a file to see its functions)."""
        base = self.resolve(path)
        if base.is_file():
            return self._outline(base)
        if not base.is_dir():
            raise ToolInputError(f"{path!r} is not a directory") if base.exists() else self._missing(path)
        limit = max(1, min(int(limit), MAX_LIST))
        files = [f for f in self.files(base) if pattern is None or _glob_match(f, pattern)]
        if not files:
            return f"(no files{' matching ' + repr(pattern) if pattern else ''})"
        if len(files) > limit:
            more = f"... {len(files) - limit} more: {_count(len(files), 'file')} in all (narrow with path or pattern)"
            return "\n".join([*files[:limit], more])
        return "\n".join(files + [f"({_count(len(files), 'file')})"])

    def _outline(self, real: Path) -> str:
        rel = self.relative(real)
        lines = self._text(real, rel).splitlines()
        found = outline(lines)
        if not found:
            return f"{rel} is a file of {_count(len(lines), 'line')}, with no definitions; read_file reads it"
        head = f"{rel} is a file of {_count(len(lines), 'line')}; its {_count(len(found), 'definition')}:"
        return "\n".join([head] + [f"{n}: {text}" for n, text in found])

    def files(self, base: Path | None = None) -> list[str]:
        """Every file under `base` not ignored, as sorted paths relative to the root."""
        base = base or self.root
        listed = _git_files(base)
        if listed is None:
            listed = _walk_files(base)
        out = []
        for rel in listed:
            real = os.path.realpath(base / rel)
            if real.startswith(str(self.root) + os.sep) and os.path.isfile(real):
                out.append((base / rel).relative_to(self.root).as_posix())
        return sorted(set(out))

    # --- read_file ------------------------------------------------------------------------------

    def read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Lines `start_line`..`end_line` (1-based, inclusive) of a text file, with a header line."""
        real = self._existing_file(path)
        lines = self._text(real, path).splitlines(keepends=True)
        total = len(lines)
        start = max(1, int(start_line))
        end = total if end_line is None else min(int(end_line), total)
        if total and start > total:
            raise ToolInputError(f"{path} has {total} lines; start_line {start} is past the end")
        if end < start and total:
            raise ToolInputError(f"end_line {end} is before start_line {start}")
        end = min(end, start + MAX_READ_LINES - 1)
        chosen, size = [], 0
        for line in lines[start - 1:end]:
            if size + len(line) > MAX_READ_BYTES and chosen:
                break
            chosen.append(line)
            size += len(line)
        last = start + len(chosen) - 1
        header = f"{self.relative(real)}: lines {start}-{last} of {total}" if total else f"{self.relative(real)}: empty"
        if last < total:
            header += f" (more: read_file with start_line={last + 1})"
        return header + "\n" + "".join(chosen)

    # --- search ---------------------------------------------------------------------------------

    def search(self, pattern: str, path: str = ".", glob: str | None = None, context: int = 2,
               max_matches: int = DEFAULT_MATCHES, ignore_case: bool = False) -> str:
        """Lines matching the regular expression `pattern`, grep-style: `file:line: text` for a
        match, `file-line- text` for context, `--` between groups, `file=line= text` for the
        definition that holds the match below it when it is not in view (as `git grep -p`), and a
        last line that counts the matches."""
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as e:
            raise ToolInputError(f"pattern is not a valid regular expression: {e}") from None
        base = self.resolve(path)
        context = max(0, min(int(context), MAX_CONTEXT))
        max_matches = max(1, min(int(max_matches), MAX_MATCHES))
        if base.is_file():
            candidates = [self.relative(base)]
        elif base.is_dir():
            candidates = self.files(base)[:MAX_SEARCH_FILES]
        else:
            raise self._missing(path)
        out: list[str] = []
        found, in_files = 0, 0
        # Until something matches: where the pattern's names are defined, for the no-match answer
        # (a model searches `quarter(11)`, a call, as a regular expression).
        words, defined = set(re.findall(r"[A-Za-z_]\w{2,}", pattern)), []
        for rel in candidates:
            if glob is not None and not _glob_match(rel, glob):
                continue
            lines = self._searchable(self.root / rel)
            if lines is None:
                continue
            hits = [i for i, line in enumerate(lines) if regex.search(line)]
            if not hits:
                if not found and len(defined) < MAX_SUGGESTIONS:
                    defined += _definitions_of(words, rel, lines)
                continue
            if found + len(hits) > max_matches:
                hits = hits[:max_matches - found]
            found, in_files = found + len(hits), in_files + 1
            out += _grep_groups(rel, lines, hits, context)
            if found >= max_matches:
                out.append(f"... stopped at {max_matches} matches (narrow with path, glob or pattern)")
                return "\n".join(out)
        if not out:
            near = f" (as a regular expression); {'; '.join(defined[:MAX_SUGGESTIONS])}" if defined else ""
            return f"no matches for {pattern!r}{near}"
        return "\n".join(out + [f"({_count(found, 'match', 'matches')} in {_count(in_files, 'file')})"])

    # --- apply_edit -----------------------------------------------------------------------------

    def apply_edit(self, path: str, search: str | None = None, replace: str | None = None,
                   diff: str | None = None) -> str:
        """Replace the one occurrence of `search` by `replace`, or apply the unified `diff`, in one
        file; returns the diff applied. An empty `search` on a missing file creates it."""
        real, rel, before, after, creating = self._planned_edit(path, search, replace, diff)
        _write_atomic(real, after)
        return unified_diff(rel, before, after, creating)

    def preview_edit(self, path: str, search: str | None = None, replace: str | None = None,
                     diff: str | None = None) -> str:
        """The diff `apply_edit` would apply and return (3 lines of context, the file's line
        numbers), nothing written; raises as it would."""
        _, rel, before, after, creating = self._planned_edit(path, search, replace, diff)
        return unified_diff(rel, before, after, creating)

    def _planned_edit(self, path: str, search: str | None, replace: str | None,
                      diff: str | None) -> tuple[Path, str, str, str, bool]:
        """(real path, relative path, text before, text after, whether it creates the file)."""
        if (diff is None) == (search is None):
            raise ToolInputError("give either search and replace, or diff")
        if search is not None and replace is None:
            raise ToolInputError("replace is missing (use an empty string to delete)")
        real = self.resolve(path)
        rel = self.relative(real)
        if ".git" in Path(rel).parts:
            raise ToolInputError(f"{path!r} is inside .git; edits there are refused")
        if real.is_dir():
            raise ToolInputError(f"{path!r} is a directory")
        creating = not real.exists()
        if creating:
            if search not in (None, "") or (diff is not None and "--- /dev/null" not in diff):
                raise ToolInputError(f"{self._missing(path)} (to create it, give an empty search)")
            if not real.parent.is_dir():
                raise ToolInputError(f"the directory of {path!r} does not exist")
            before = ""
        else:
            before = self._text(real, path)
        if diff is not None:
            after = apply_unified_diff(before, diff)
        else:
            after = replace_once(before, search or "", replace or "", creating)
        if after == before:
            raise ToolInputError("the edit changes nothing")
        return real, rel, before, after, creating

    # --- helpers --------------------------------------------------------------------------------

    def _existing_file(self, path: str) -> Path:
        real = self.resolve(path)
        if not real.exists():
            raise self._missing(path)
        if not real.is_file():
            raise ToolInputError(f"{path!r} is not a file")
        return real

    def _missing(self, path: str) -> ToolInputError:
        """`path` does not exist: the error names the files of that name or a close one, so the
        next call can find it (a model that guessed a path otherwise gives up on the error)."""
        files = self.files()[:MAX_SEARCH_FILES]
        by_name: dict[str, list[str]] = {}
        for rel in files:
            by_name.setdefault(Path(rel).name, []).append(rel)
        names = difflib.get_close_matches(Path(path).name, list(by_name), n=3, cutoff=0.75)
        near = [rel for name in names for rel in by_name[name] if rel != path][:MAX_SUGGESTIONS]
        if near:
            return ToolInputError(f"{path!r} does not exist; did you mean {' or '.join(map(repr, near))}?")
        return ToolInputError(f"{path!r} does not exist; search finds the file that holds a name, "
                              "list_files lists the files")

    def _text(self, real: Path, path: str) -> str:
        size = real.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ToolInputError(f"{path} is {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit")
        data = real.read_bytes()
        if b"\x00" in data[:8192]:
            raise ToolInputError(f"{path} is a binary file")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolInputError(f"{path} is not UTF-8 text") from None

    def _searchable(self, real: Path) -> list[str] | None:
        try:
            return self._text(real, str(real)).splitlines()
        except (ToolInputError, OSError):
            return None


def _glob_match(rel: str, pattern: str) -> bool:
    """A glob against the path, or against the file name when the glob has no `/`."""
    return fnmatch.fnmatch(rel, pattern) or ("/" not in pattern and fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pattern))


def _grep_groups(rel: str, lines: list[str], hits: list[int], context: int) -> list[str]:
    out: list[str] = []
    shown: set[int] = set()
    shown_to = -1
    hit_set = set(hits)
    for i in hits:
        lo, hi = max(0, i - context), min(len(lines) - 1, i + context)
        if lo > shown_to + 1 and out:
            out.append("--")
        holder = enclosing(lines, i)
        if holder is not None and holder not in shown and holder < max(lo, shown_to + 1):
            out.append(f"{rel}={holder + 1}= {_cut(lines[holder])}")
            shown.add(holder)
        for j in range(max(lo, shown_to + 1), hi + 1):
            mark = ":" if j in hit_set else "-"
            out.append(f"{rel}{mark}{j + 1}{mark} {_cut(lines[j])}")
            shown.add(j)
        shown_to = max(shown_to, hi)
    return out


def _definitions_of(words: set[str], rel: str, lines: list[str]) -> list[str]:
    """"NAME is defined at FILE:LINE: TEXT" for each definition in `lines` of a name in `words`."""
    return [f"{name} is defined at {rel}:{i + 1}: {_cut(line.strip())}" for i, line in enumerate(lines)
            if any(w in line for w in words) and (name := defined_name(line)) in words]


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + "..."


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _git_files(base: Path) -> list[str] | None:
    """Tracked and untracked-but-not-ignored files under `base`, or None outside a git work tree."""
    try:
        done = subprocess.run(["git", "-C", str(base), "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard"], capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [p for p in done.stdout.decode("utf-8", "replace").split("\0") if p]


def _walk_files(base: Path) -> list[str]:
    """The files under `base`, skipping WALK_SKIP and the simple patterns of `base`'s .gitignore."""
    patterns = _ignore_patterns(base / ".gitignore")
    out: list[str] = []
    for folder, dirs, names in os.walk(base):
        rel_dir = Path(folder).relative_to(base)
        dirs[:] = sorted(d for d in dirs if d not in WALK_SKIP and not _ignored((rel_dir / d).as_posix(), d, patterns, True))
        for name in names:
            rel = (rel_dir / name).as_posix()
            if not _ignored(rel, name, patterns, False):
                out.append(rel)
            if len(out) > MAX_SEARCH_FILES:
                return out
    return out


def _ignore_patterns(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("#", "!"))]


def _ignored(rel: str, name: str, patterns: list[str], is_dir: bool) -> bool:
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        p = pattern.strip("/")
        if dir_only and not is_dir:
            continue
        if ("/" in p and fnmatch.fnmatch(rel, p)) or fnmatch.fnmatch(name, p):
            return True
    return False


def _write_atomic(real: Path, text: str) -> None:
    mode = real.stat().st_mode & 0o7777 if real.exists() else None
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
