"""`localbatch bench report`: Markdown tables from --json records, each under its commit, machine
and date."""

from __future__ import annotations

import json

import pytest

from app.bench.report import report
from app.engine.types.errors import LocalbatchError

RECORD = {"benchmark": "compare",
          "environment": {"commit": "b8567f6", "cpu": "AMD EPYC 9B14", "cpu_flags": ["avx2", "avx512f"],
                          "cpu_count": 2, "time": "2026-11-28T10:00:00+0000"},
          "settings": {"model": "qwen2.5-coder-1.5b-instruct", "rounds": 1, "json": "x.json", "svg": None},
          "model": "m.gguf", "rows": [{"concurrency": 1, "localbatch_tok_s": 19.9, "ratio": 1.013},
                                      {"concurrency": 16, "localbatch_tok_s": 140.0, "ratio": None}]}


def test_a_record_becomes_a_table_under_its_commit_machine_and_date(tmp_path):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(RECORD))
    text = report([path])
    head = text.splitlines()[0]
    assert all(s in head for s in ("compare", "b8567f6", "AMD EPYC 9B14", "avx2, avx512f", "2026-11-28"))
    assert "| concurrency | localbatch_tok_s | ratio |" in text
    assert "| 1 | 19.9 | 1.013 |" in text and "| 16 | 140 | - |" in text
    assert "`model=qwen2.5-coder-1.5b-instruct`" in text and "json=" not in text


def test_not_a_record_is_a_one_line_error(tmp_path):
    path = tmp_path / "other.json"
    path.write_text("{}")
    with pytest.raises(LocalbatchError, match="not a benchmark record"):
        report([path])
    with pytest.raises(LocalbatchError, match="not a benchmark record"):
        report([tmp_path / "missing.json"])
