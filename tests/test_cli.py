"""The command line on a tiny model: `generate --json` and `bench --json`."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json(tiny_gguf_factory):
    model = str(tiny_gguf_factory("qwen3", context_length=512))
    proc = run_cli("generate", "--model", model, "--prompt", "hello world", "--max-tokens", "5", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"prompt_ids", "output_ids", "text", "finish_reason"}
    assert 1 <= len(out["output_ids"]) <= 5 and out["finish_reason"] in ("stop", "length")


def test_bench_json_has_sweep(tiny_gguf_factory):
    model = str(tiny_gguf_factory("llama", context_length=512))
    proc = run_cli("bench", "--model", model, "--num-prompts", "3", "--input-len", "20", "--output-len", "6",
                   "--concurrency", "1,2", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] == 3 and report["output_tokens"] == 18
    for key in ("duration_s", "output_tok_s", "total_tok_s", "ttft_ms", "tpot_ms"):
        assert key in report
    assert [s["concurrency"] for s in report["sweep"]] == [1, 2]
    assert all(s["decode_tok_s"] > 0 and s["output_tok_s"] > 0 for s in report["sweep"])


def test_invalid_engine_setting_is_one_line(tiny_gguf_factory):
    model = str(tiny_gguf_factory("llama", context_length=512))
    proc = run_cli("generate", "--model", model, "--prompt", "x", "--max-num-seqs", "0", "--device", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["localbatch: error: invalid max_num_seqs=0: must be a positive integer"]
