"""Does the app slow its engine in a real terminal? Drives `localbatch` in tmux as a person would.

    python benchmarks/tmux_tabs.py --tabs 1,4,8 [--model NAME] [--idle 30] [--pyspy DIR]

For each tab count: a fresh app in a 160x48 tmux window (`--device cpu`, temperature 0, a
throwaway data dir), N-1 times ctrl+n, one long prompt typed and broadcast with ctrl+b. While
all N tabs decode it reads the screen a few times a second: the throughput panel's step time and
the per-tab tok/s rows. It also reads the process's and its main (UI) thread's CPU from /proc.
After the last count it leaves the app idle and measures its CPU over `--idle` seconds.
Compare with `localbatch bench --concurrency 1,4,8` run just before. Needs tmux; Linux only.
The machine must be quiet: the load average is printed with each figure."""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSION = "lbbench"
PROMPT = "Write a very long story about a lighthouse keeper who collects clocks, chapter by chapter."
_STEP = re.compile(r"batch (\d+) seq.*\n.*step ([\d.]+) (ms|s)\b")
_ROW = re.compile(r"■ (.{14})\s+([\d.]+)\s+(\S+ ?m?s)")
_CLK = os.sysconf("SC_CLK_TCK")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen() -> str:
    return tmux("capture-pane", "-p", "-t", SESSION)


def cpu_ticks(pid: int, tid: int | None = None) -> int:
    """utime + stime of a process (or one of its threads), in clock ticks."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


@dataclass
class Run:
    tabs: int
    steps_ms: list[float] = field(default_factory=list)
    tab_rates: list[float] = field(default_factory=list)  # summed per-tab tok/s, per sample
    cpu: float = 0.0
    ui_cpu: float = 0.0
    tmux_cpu: float = 0.0
    replies: list[tuple[int, float]] = field(default_factory=list)  # (tokens, tok/s) per reply, from the chat DB
    load_before: float = 0.0
    load_after: float = 0.0

    def line(self) -> str:
        parts = [f"{self.tabs:>2} tabs:"]
        if self.steps_ms:
            step = statistics.median(self.steps_ms)
            parts.append(f"step p50 {step:6.1f} ms (n={len(self.steps_ms)}, min {min(self.steps_ms):.0f} "
                         f"max {max(self.steps_ms):.0f}) = {self.tabs * 1000 / step:6.1f} tok/s;")
        if self.replies:
            total = sum(rate for _, rate in self.replies)
            tokens = sorted(n for n, _ in self.replies)
            parts.append(f"replies: {total:6.1f} tok/s summed over {len(self.replies)} "
                         f"({tokens[0]}-{tokens[-1]} tok);")
        parts.append(f"process CPU {self.cpu:.0%}, UI thread {self.ui_cpu:.0%}, tmux {self.tmux_cpu:.0%}; "
                     f"load {self.load_before:.2f} -> {self.load_after:.2f}")
        return " ".join(parts)


def start_app(args: argparse.Namespace, data: Path) -> int:
    config = data / "config.toml"
    config.write_text(f"[sampling]\ntemperature = 0.0\nmax_tokens = {args.max_tokens}\n")
    cmd = [sys.executable, "-m", "app.cli", "--device", "cpu", "--data-dir", str(data / "data"),
           "--config", str(config)] + (["--model", args.model] if args.model else []) + (args.extra or [])
    if args.remote:
        cmd = [c for c in cmd if c not in ("--device", "cpu")] + ["--backend-url", args.remote]
    env = " ".join(f"{k}={v}" for k, v in (kv.split("=", 1) for kv in args.env or []))
    shell = f"cd {args.cwd} && exec env {env} {' '.join(cmd)}"
    tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "48", shell)
    pid = int(tmux("display", "-p", "-t", SESSION, "#{pane_pid}").strip())
    wait_for(lambda s: "Throughput" in s, 180)
    time.sleep(2)
    return pid


def wait_for(cond, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = screen()
        if cond(text):
            return text
        time.sleep(0.3)
    raise TimeoutError(screen())


def parse_step(text: str) -> tuple[int, float] | None:
    m = _STEP.search(text)
    if not m:
        return None
    value = float(m.group(2)) * (1000 if m.group(3) == "s" else 1)
    return int(m.group(1)), value


def run_tabs(args: argparse.Namespace, n: int) -> Run:
    run = Run(n, load_before=load())
    with tempfile.TemporaryDirectory(prefix="lbtmux") as tmp:
        pid = start_app(args, Path(tmp))
        try:
            open_tabs(n - 1)
            broadcast(PROMPT)
            sample(run, pid, n, args)
            wait_for(lambda s: not busy(s), args.timeout)  # no tab title marked busy
            run.replies = replies(Path(tmp) / "data")
            if args.idle and n == args.idle_after:
                idle_cpu(pid, args.idle)
        finally:
            tmux("send-keys", "-t", SESSION, "C-q")
            time.sleep(1.5)
            subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    run.load_after = load()
    return run


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


def tmux_server_pid() -> int:
    return int(tmux("display", "-p", "#{pid}").strip())


def sample(run: Run, pid: int, n: int, args: argparse.Namespace) -> None:
    """Read the panels while all `n` tabs decode; CPU over the same stretch."""
    if args.remote:
        return sample_remote(run, pid, n, args)
    server = tmux_server_pid()
    start = None
    end = time.monotonic() + args.timeout
    seen_prev = None
    while time.monotonic() < end:
        text = screen()
        step = parse_step(text)
        if step and step[0] == n and busy(text):
            if start is None:
                start = (time.monotonic(), cpu_ticks(pid), cpu_ticks(pid, pid), cpu_ticks(server))
                if args.pyspy:
                    spy(pid, n, args)
            elif step != seen_prev:
                run.steps_ms.append(step[1])
                rates = [float(m.group(2)) for m in _ROW.finditer(text)]
                if len(rates) >= n:
                    run.tab_rates.append(sum(rates[:n]))
            seen_prev = step
            last = (time.monotonic(), cpu_ticks(pid), cpu_ticks(pid, pid), cpu_ticks(server))
        elif start is not None:
            break
        time.sleep(0.5)
    if start is not None:
        wall = last[0] - start[0]
        run.cpu = (last[1] - start[1]) / _CLK / wall if wall else 0.0
        run.ui_cpu = (last[2] - start[2]) / _CLK / wall if wall else 0.0
        run.tmux_cpu = (last[3] - start[3]) / _CLK / wall if wall else 0.0


def sample_remote(run: Run, pid: int, n: int, args: argparse.Namespace) -> None:
    """A remote backend has no step line: CPU from the first reply text to the last busy tab."""
    server = tmux_server_pid()
    wait_for(lambda s: "Assistant" in s, args.timeout)
    start = (time.monotonic(), cpu_ticks(pid), cpu_ticks(pid, pid), cpu_ticks(server))
    if args.pyspy:
        spy(pid, n, args)
    wait_for(lambda s: not busy(s), args.timeout)
    last = (time.monotonic(), cpu_ticks(pid), cpu_ticks(pid, pid), cpu_ticks(server))
    wall = last[0] - start[0]
    run.cpu, run.ui_cpu, run.tmux_cpu = ((last[i] - start[i]) / _CLK / wall for i in (1, 2, 3))


def spy(pid: int, n: int, args: argparse.Namespace) -> None:
    out = Path(args.pyspy) / f"tabs{n}"
    subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(args.pyspy_s), "--rate", "200",
                      *args.pyspy_flags.split(), "--format", "raw", "-o", f"{out}.txt"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def idle_cpu(pid: int, seconds: float) -> None:
    time.sleep(5)  # the last reply's end, the panels settling
    before, t0, l0 = cpu_ticks(pid), time.monotonic(), load()
    time.sleep(seconds)
    share = (cpu_ticks(pid) - before) / _CLK / (time.monotonic() - t0)
    print(f"idle CPU over {seconds:.0f} s: {share:.1%} of a core (load {l0:.2f} -> {load():.2f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tabs", default="1,4,8")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--idle", type=float, default=0, help="seconds of idle CPU to measure after a run")
    p.add_argument("--idle-after", type=int, default=1, help="the tab count after whose run idle CPU is read")
    p.add_argument("--cwd", default=str(ROOT), help="checkout to run the app from")
    p.add_argument("--pyspy", default=None, help="folder for py-spy raw profiles (one per tab count)")
    p.add_argument("--pyspy-s", type=int, default=15)
    p.add_argument("--pyspy-flags", default="--gil --threads")
    p.add_argument("--env", action="append", help="VAR=VALUE for the app")
    p.add_argument("--extra", nargs="*", help="more app arguments")
    p.add_argument("--remote", default=None, help="run the app with --backend-url URL")
    args = p.parse_args()
    if args.pyspy:
        Path(args.pyspy).mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in args.tabs.split(",")):
        print(run_tabs(args, n).line(), flush=True)


if __name__ == "__main__":
    main()
