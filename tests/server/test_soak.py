"""A 60-second soak of `localbatch serve` on SmolLM2 (benchmarks/serving/soak.py, loopback only): a mixed
load with disconnects and every kind of malformed body; no 5xx, every bad body a 4xx with an
OpenAI error object, nothing running and no KV block held afterwards, fds and threads flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow


def test_sixty_second_soak_loses_nothing(tmp_path: Path) -> None:
    from app.engine.gguf.catalog import installed_path

    if installed_path(MODEL) is None:
        pytest.skip(f"{MODEL} is not pulled: run `localbatch pull {MODEL}` (.ci/run does)")
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "research", "soak", "--model", MODEL, "--duration", "60",
         "--clients", "4", "--warmup", "20", "--json", str(out), "--", "--kv-cache-bytes", str(64 << 20),
         "--kv-disk-cache-bytes", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["5xx"] == 0, report["statuses"]
    assert report["malformed"] >= 7 and report["malformed_wrong"] == [], report["malformed_wrong"]
    assert report["malformed_answered_4xx_with_error"] == report["malformed"]
    assert report["kv_blocks_in_use_after"] == 0 and report["running_after"] == 0
    assert report["requests"] > report["malformed"] and not report["client_errors"], report["client_errors"]
    assert report["ok"] and proc.returncode == 0, json.dumps({k: v for k, v in report.items() if k != "samples"})
