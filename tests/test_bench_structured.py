"""`localbatch bench throughput --json-schema`: the structured-output comparison on a tiny model, in process."""

from __future__ import annotations

import argparse
import json

import pytest

from app.bench.commands import add_throughput_args
from app.bench.datasets import Shape
from app.bench.throughput import load_schema, structured_sweep
from app.engine.core.llm_engine import LLMEngine
from app.engine.types.errors import LocalbatchError


def test_structured_sweep_reports_both_rates(tiny_gguf_factory, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    parser = argparse.ArgumentParser()
    add_throughput_args(parser)
    args = parser.parse_args(["--input-len", "8", "--output-len", "6", "--concurrency", "2",
                              "--json-schema", str(path)])
    engine = LLMEngine(str(tiny_gguf_factory("qwen3")), device="cpu", dtype="float32", kv_cache_blocks=64)
    rows = structured_sweep(engine, Shape.from_args(args), [2], load_schema(args.json_schema), repeats=1)
    assert [r["concurrency"] for r in rows] == [2]
    assert rows[0]["decode_tok_s"] > 0 and rows[0]["decode_tok_s_constrained"] > 0


@pytest.mark.parametrize("content,words", [(None, "cannot read"), ("{", "is not JSON"), ("[1]", "JSON object")])
def test_bad_schema_file_is_one_clear_error(tmp_path, content, words):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LocalbatchError, match=words):
        load_schema(str(path))
