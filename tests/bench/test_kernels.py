"""`localbatch bench kernels`: the shapes and types it measures, and one tiny run through the
command line to its record. The figures themselves are not checked here (docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from app.bench import kernels
from app.bench.kernels import MODELS, NOT_NATIVE, TYPES, ModelShape, cases
from app.cli import main
from app.kernels import cpu_qgemm


def test_the_catalog_models_shapes_and_the_types_forms():
    coder = MODELS["qwen2.5-coder-1.5b-instruct"].matrices()
    assert coder == {"q": (1536, 1536), "k": (256, 1536), "v": (256, 1536), "o": (1536, 1536),
                     "gate": (8960, 1536), "up": (8960, 1536), "down": (1536, 8960)}
    assert MODELS["qwen2.5-coder-0.5b-instruct"].matrices()["k"] == (128, 896)
    assert MODELS["smollm2-135m-instruct"].matrices()["down"] == (576, 1536)
    assert {t: f for t, (f, _) in TYPES.items()} == {"Q4_K": "q4k", "Q5_K": "q5", "Q6_K": "q6", "Q8_0": "q8",
                                                     "Q4_0": "q4_0", "Q5_0": "q5_0", "IQ4_NL": "q8"}
    assert set(NOT_NATIVE) == {"Q5_K", "IQ4_NL"}


def test_a_k_quant_skips_what_is_not_whole_blocks_of_256():
    rows = cases(["qwen2.5-coder-0.5b-instruct"], ["Q4_K", "Q8_0"])
    skipped = {(r["type"], r["matrix"]) for r in rows if r["skip"]}
    assert skipped == {("Q4_K", m) for m in ("q", "k", "v", "o", "gate", "up")}  # K = 896; down's is 4864
    assert all(r["skip"] is None for r in rows if r["type"] == "Q8_0")


@pytest.mark.parametrize("form", ["q4k", "q5", "q6", "q8", "q4_0", "q5_0"])
def test_each_form_is_made_at_its_shape(form):
    w = kernels.make_weight(form, 24, 512)
    assert (w.out_features, w.in_features) == (24, 512) and w.name == form


@pytest.mark.skipif(cpu_qgemm._library() is None, reason="no C compiler or no AVX2/FMA/F16C here")
def test_one_tiny_case_runs_and_writes_the_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(MODELS, "tiny", ModelShape(256, 512, 2, 1, 128))
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--models", "tiny", "--types", "Q4_K,Q8_0", "--rows", "8", "--threads", "1",
                 "--repeats", "1", "--peak-seconds", "0.01", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "kernels" and {"commit", "cpu", "cpu_flags"} <= rec["environment"].keys()
    assert rec["isa"] == cpu_qgemm.isa() and rec["int8_peak_gmacs"]["1"] > 0 and rec["fp32_peak_gmacs"]["1"] > 0
    assert [(r["type"], r["rows"], r["threads"]) for r in rec["rows"]] == [("Q4_K", 8, 1), ("Q8_0", 8, 1)]
    assert all(r["layer_gmacs"] > 0 and r["pct_peak"] > 0 and r["down"] > 0 for r in rec["rows"])
    assert "% of int8 peak" in capsys.readouterr().out


def test_an_unknown_type_is_one_line(capsys):
    assert main(["bench", "kernels", "--types", "Q3_K"]) != 0
    assert "unknown type Q3_K" in capsys.readouterr().err
