"""Files attached to a message: read (text only, bounded), written as fenced blocks with their
names at the start of the message (so the prefix cache serves them again in the next turn and in
forks), found again in a stored message, and `@path` completion for the prompt input."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from app.engine.types.errors import LocalbatchError

MAX_FILE_BYTES = 512 * 1024  # a larger file would not fit a catalog model's context anyway
_SNIFF_BYTES = 8192

_LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".ts": "typescript",
    ".tsx": "tsx", ".jsx": "jsx", ".rs": "rust", ".go": "go", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp",
    ".hpp": "cpp", ".java": "java", ".kt": "kotlin", ".rb": "ruby", ".php": "php", ".cs": "csharp",
    ".swift": "swift", ".sh": "bash", ".bash": "bash", ".zsh": "bash", ".sql": "sql", ".html": "html",
    ".css": "css", ".scss": "scss", ".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml",
    ".md": "markdown", ".xml": "xml", ".lua": "lua", ".r": "r", ".scala": "scala", ".hs": "haskell",
    ".ml": "ocaml", ".ex": "elixir", ".zig": "zig", ".dart": "dart", ".tcss": "css", ".ini": "ini",
}
_NAMES = {"Makefile": "make", "Dockerfile": "dockerfile", "CMakeLists.txt": "cmake"}

# "File: name" then a fence of 3+ backticks (longer than any run inside), the text, the same fence.
_BLOCK = re.compile(r"File: (?P<name>[^\n]+)\n(?P<fence>`{3,})(?P<lang>[^\n`]*)\n(?P<text>.*?)\n(?P=fence)\n*",
                    re.DOTALL)


class AttachError(LocalbatchError):
    """A file cannot be attached (missing, a directory, binary, too large); the message names it."""


@dataclass(frozen=True)
class Attachment:
    name: str  # as given (relative paths stay relative: that is what the model and the reader see)
    text: str
    language: str = ""

    @property
    def num_lines(self) -> int:
        return self.text.count("\n") + (not self.text.endswith("\n"))

    def block(self) -> str:
        """This file as the model reads it: its name, then a fenced block."""
        longest = max((len(run) for run in re.findall(r"`+", self.text)), default=0)
        fence = "`" * max(3, longest + 1)
        return f"File: {self.name}\n{fence}{self.language}\n{self.text.rstrip(chr(10))}\n{fence}\n"

    def chip(self) -> str:
        return f"{self.name} ({self.num_lines:,} lines)"


def language_of(path: Path) -> str:
    return _NAMES.get(path.name, _LANGUAGES.get(path.suffix.lower(), ""))


def read_attachment(path: str | Path, cwd: Path | None = None) -> Attachment:
    """Read a text file to attach; raises `AttachError` with a one-line reason."""
    given = str(path)
    full = Path(os.path.expanduser(given))
    if not full.is_absolute():
        full = (cwd or Path.cwd()) / full
    if not full.exists():
        raise AttachError(f"{given}: no such file")
    if full.is_dir():
        raise AttachError(f"{given}: is a directory; attach the files in it one by one")
    try:
        size = full.stat().st_size
        if size > MAX_FILE_BYTES:
            raise AttachError(f"{given}: {size / 1024:,.0f} KiB, over the {MAX_FILE_BYTES // 1024} KiB an attachment may be")
        raw = full.read_bytes()
    except OSError as e:
        raise AttachError(f"{given}: cannot read it ({e.strerror or e})") from None
    if b"\0" in raw[:_SNIFF_BYTES]:
        raise AttachError(f"{given}: a binary file; only text files can be attached")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AttachError(f"{given}: not UTF-8 text; only text files can be attached") from None
    return Attachment(given, text.replace("\r\n", "\n"), language_of(full))


def compose_message(attachments: list[Attachment], text: str) -> str:
    """The message sent: the files first (a stable prefix across turns and forks), then the text."""
    blocks = "\n".join(a.block() for a in attachments)
    return f"{blocks}\n{text}".strip() if blocks else text


def split_message(content: str) -> tuple[list[Attachment], str]:
    """A stored message back into its leading file blocks and the typed text (edit, history)."""
    attachments, pos = [], 0
    while (match := _BLOCK.match(content, pos)) is not None:
        attachments.append(Attachment(match["name"], match["text"] + "\n", match["lang"].strip()))
        pos = match.end()
    return attachments, content[pos:].lstrip("\n")


def display_text(content: str) -> str:
    """A user message as shown: each leading file block as one line (the file is in the store)."""
    attachments, text = split_message(content)
    if not attachments:
        return content
    lines = [f"📎 {a.chip()}" for a in attachments]
    return "\n".join(lines + ([text] if text else []))


_AT_PATH = re.compile(r"(?:^|(?<=\s))@(?P<path>[^\s@]+)")


def mentioned_files(text: str, cwd: Path | None = None) -> list[str]:
    """The `@path` words of `text` that name existing files, in order, once each."""
    seen: list[str] = []
    for match in _AT_PATH.finditer(text):
        path = match["path"].rstrip(".,;:!?)")
        full = Path(os.path.expanduser(path))
        full = full if full.is_absolute() else (cwd or Path.cwd()) / full
        if path not in seen and full.is_file():
            seen.append(path)
    return seen


def complete_path(partial: str, cwd: Path | None = None) -> list[str]:
    """Completions of a partial path (as typed after `@`): directories end in "/"; hidden entries
    only when the partial name starts with a dot."""
    head, _, stem = partial.rpartition("/")
    base = Path(os.path.expanduser(head or ".")) if head or not partial.startswith("/") else Path("/")
    if not base.is_absolute():
        base = (cwd or Path.cwd()) / base
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except OSError:
        return []
    prefix = f"{head}/" if head or partial.startswith("/") else ""
    out = []
    for entry in entries:
        if not entry.name.startswith(stem) or (entry.name.startswith(".") and not stem.startswith(".")):
            continue
        out.append(prefix + entry.name + ("/" if entry.is_dir() else ""))
    return out


def complete(partial: str, cwd: Path | None = None) -> tuple[str, list[str]]:
    """`partial` completed as far as its completions agree (the one completion when there is
    one), and the completions (a tab shows them when there are several, or none)."""
    options = complete_path(partial, cwd)
    if len(options) == 1:
        return options[0], options
    return os.path.commonprefix(options) or partial, options


def options_hint(options: list[str], limit: int) -> str:
    """The completions a tab found, on one line (the first `limit`)."""
    if not options:
        return "no file matches"
    return "  ".join(options[:limit]) + (" …" if len(options) > limit else "")
