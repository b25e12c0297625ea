"""Drives `localbatch` (or any command) in a tmux window as a person would: keys in, the screen
and the app's chat database out, and CPU ticks from /proc. A helper of this group's benchmarks,
not one itself. Linux only (tmux, /proc)."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSION = "lbbench"
SIZE = (160, 48)
_STEP = re.compile(r"batch (\d+) seq.*\n.*step ([\d.]+) (ms|s)\b")
_CLK = os.sysconf("SC_CLK_TCK")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def new_session(shell: str, session: str = SESSION) -> None:
    """A detached 160x48 window running `shell` (from the repository root)."""
    tmux("new-session", "-d", "-s", session, "-x", str(SIZE[0]), "-y", str(SIZE[1]), f"cd {ROOT} && {shell}")


def kill_session(session: str = SESSION) -> None:
    subprocess.run(["tmux", "kill-session", "-t", session], check=False, capture_output=True)


def screen(session: str = SESSION) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def server_pid() -> int:
    """The tmux server's pid (its CPU is the terminal's cost)."""
    return int(tmux("display", "-p", "#{pid}").strip())


def cpu_ticks(pid: int, tid: int | None = None) -> int:
    """utime + stime of a process (or one of its threads), in clock ticks."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_seconds(ticks: int) -> float:
    return ticks / _CLK


def wait_for(cond: Callable[[str], bool], timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = screen()
        if cond(text):
            return text
        time.sleep(0.3)
    raise TimeoutError(screen())


def app_config(max_tokens: int, tools: bool = False) -> str:
    """The benchmarked app's config: greedy, `max_tokens` a reply; the built-in tools only if asked."""
    return f"[sampling]\ntemperature = 0.0\nmax_tokens = {max_tokens}\n" + ("" if tools else "\n[tools]\nbuiltin = false\n")


def start_app(data: Path, max_tokens: int, model: str | None = None, extra: list[str] | None = None,
              env: list[str] | None = None, remote: str | None = None, tools: bool = False) -> int:
    """A fresh app (greedy, `max_tokens` a reply, chats in a throwaway `data` dir) in the tmux
    window; its pid once the panels show. `remote`: run it with --backend-url instead of an engine.
    `tools`: the built-in tools offered (their prompt and the calls' constraint change what the
    engine computes); off, a tab's request is the chat template of its messages alone."""
    config = data / "config.toml"
    config.write_text(app_config(max_tokens, tools))
    cmd = [sys.executable, "-m", "app.cli", "--data-dir", str(data / "data"), "--config", str(config),
           *(["--model", model] if model else []), *(extra or [])]
    cmd += ["--backend-url", remote] if remote else ["--device", "cpu"]
    new_session(f"exec env {' '.join(env or [])} {' '.join(cmd)}")
    pid = int(tmux("display", "-p", "-t", SESSION, "#{pane_pid}").strip())
    wait_for(lambda s: "Throughput" in s, 180)
    time.sleep(2)
    return pid


def quit_app() -> None:
    tmux("send-keys", "-t", SESSION, "C-q")
    time.sleep(1.5)
    kill_session()


def parse_step(text: str) -> tuple[int, float] | None:
    """(batch size, step ms) from the throughput panel."""
    m = _STEP.search(text)
    if not m:
        return None
    return int(m.group(1)), float(m.group(2)) * (1000 if m.group(3) == "s" else 1)


def open_tabs(n: int) -> None:
    """`n` more tabs (ctrl+n); the last one opened is shown."""
    for _ in range(n):
        tmux("send-keys", "-t", SESSION, "C-n")
        time.sleep(0.4)


def broadcast(prompt: str) -> None:
    """`prompt` typed into the shown tab's input and sent to every idle tab (ctrl+b)."""
    tmux("send-keys", "-t", SESSION, "-l", prompt)
    time.sleep(0.3)
    tmux("send-keys", "-t", SESSION, "C-b")


def busy(text: str) -> bool:
    """A tab title marked as generating (the tab row is the screen's second line)."""
    return "●" in text.split("\n")[1]


def replies(data: Path) -> list[tuple[int, float]]:
    """(tokens, tok/s) of each reply in the open tabs, as the app measured and stored it."""
    db = sqlite3.connect(data / "chats.sqlite3")
    try:
        rows = db.execute("SELECT num_tokens, tokens_per_s FROM messages JOIN chats ON chats.id = messages.chat_id"
                          " WHERE role = 'assistant' AND chats.open = 1").fetchall()
    finally:
        db.close()
    return [(int(n or 0), float(r or 0.0)) for n, r in rows]
