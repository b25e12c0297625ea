"""Shared fixtures: the embedded model file (assembled once per session) and tiny GGUFs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A checkout's own tests import the package from the working tree.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The real Gemma 3 270M Q4_K_M file, assembled into the user cache dir on first use."""
    from app.engine.gguf.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_gguf_factory(tmp_path_factory):
    """tiny_gguf_factory(arch, **kw) -> path of a tiny random-weight GGUF (cached per arguments)."""
    from tests.support.tiny_gguf import write_tiny_gguf

    made: dict[tuple, Path] = {}

    def make(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            path = tmp_path_factory.mktemp("tiny") / f"{arch}.gguf"
            write_tiny_gguf(path, arch, **kw)
            made[key] = path
        return made[key]

    return make
