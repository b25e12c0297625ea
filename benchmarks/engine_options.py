"""The command line's engine options, for the scripts that start an engine in a worker process
(`app.bench.paired.EngineWorker`) beside a `localbatch serve` or app taking the same options."""

from __future__ import annotations

import argparse
from typing import Any


def engine_kwargs_from_argv(argv: list[str]) -> dict[str, Any]:
    """LLMEngine's keyword arguments for `localbatch` engine options `argv` (e.g. --model NAME)."""
    from app.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(argv))
