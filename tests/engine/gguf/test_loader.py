"""Bad model files give one clear error line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from app.engine.gguf.loader import load_gguf
from app.engine.types.errors import GGUFError
from tests.support.tiny_gguf import write_bad_gguf

EXPECTED = {
    "not_gguf": "not a GGUF",
    "truncated": "truncated",
    "unsupported_arch": "mamba",
    "unsupported_type": "IQ2_XXS",
    "missing_tensor": "blk.0.ffn_up.weight",
    "shape_mismatch": "blk.0.attn_q.weight",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_bad_file_raises_one_line(kind, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    write_bad_gguf(path, kind)
    with pytest.raises(GGUFError) as err:
        load_gguf(path, "cpu", torch.float32)
    message = str(err.value)
    assert "\n" not in message
    assert EXPECTED[kind].lower() in message.lower(), message


def test_unsupported_arch_lists_supported(tmp_path):
    path = tmp_path / "m.gguf"
    write_bad_gguf(path, "unsupported_arch")
    with pytest.raises(GGUFError, match=r"llama, qwen2, qwen3, gemma3"):
        load_gguf(path, "cpu", torch.float32)


@pytest.mark.parametrize("kind", ["not_gguf", "unsupported_type"])
def test_cli_reports_bad_file_without_traceback(kind, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    write_bad_gguf(path, kind)
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localbatch: error:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf", "cpu", torch.float32)
