"""A benchmark's result as one JSON object that says where it came from: the commit, the CPU
model and the instruction sets that matter here, the torch version, the device, the settings.

    {"benchmark": "throughput", "environment": {...}, "settings": {...}, <the results' keys>}

The results stay at the top level, so a reader that knew an earlier report's keys (`sweep`,
`output_tok_s`, ...) still finds them. `write` takes a path, or "-" for stdout."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


# The flags the C kernels and llama.cpp choose their code by (AMX: any of its flags).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
_REPO = Path(__file__).resolve().parents[2]


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it lists (Linux /proc/cpuinfo; elsewhere the
    platform's processor string and no flags)."""
    from app.kernels.cpu_info import cpu_flags, cpu_model  # app.kernels imports torch: not for --help

    flags = cpu_flags()
    return cpu_model() or platform.processor() or platform.machine(), [f for f in CPU_FLAGS if f in flags]


def git_commit(repo: Path = _REPO) -> str | None:
    """The checkout's commit (with "-dirty" when tracked files differ), or None outside a checkout
    (an installed wheel: its folder may sit inside some other repository)."""
    if not (repo / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str | None = None) -> dict[str, Any]:
    cpu, flags = cpu_model_and_flags()
    return {"commit": git_commit(), "cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "torch": _version("torch"), "python": platform.python_version(), "platform": platform.platform(),
            "device": device, "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def record(benchmark: str, settings: dict[str, Any], results: dict[str, Any], device: str | None = None) -> dict:
    reserved = {"benchmark", "environment", "settings"} & results.keys()
    if reserved:
        raise ValueError(f"result keys {sorted(reserved)} are the record's own")
    return {"benchmark": benchmark, "environment": environment(device), "settings": settings, **results}


def add_json_arg(p: argparse.ArgumentParser) -> None:
    """`--json [PATH]`, which every benchmark takes."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON (with the commit, CPU, flags, torch and settings) to PATH; "
                        "without PATH, or '-': print that JSON instead of the text report")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """A command line's options as a record's settings: the plain values (paths as text)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, Path, type(None))) and k not in ("func", "command")}


def write(path: str, rec: dict[str, Any]) -> None:
    """One JSON object to `path` ("-": stdout, on one line)."""
    if path == "-":
        print(json.dumps(rec), flush=True)
        return
    Path(path).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
