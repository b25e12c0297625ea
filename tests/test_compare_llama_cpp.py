"""`localbatch bench compare`: the table, terminal chart and SVG, and the figures read from both
engines' output (the runs themselves are benchmarks)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from app.bench import compare

ROWS = [(1, 19.9, 60.0), (4, 75.1, 120.0), (8, 110.0, 150.0), (16, 140.0, 0.0)]


def test_table_has_a_ratio_per_concurrency():
    table = compare.format_table(ROWS)
    assert "0.33x" in table and "0.63x" in table
    assert table.splitlines()[-1].rstrip().endswith("-")  # no peer figure: no ratio


def test_terminal_chart_and_svg_draw_both_engines():
    chart = compare.terminal_chart(ROWS, width=20)
    assert chart.count("│") == 2 * len(ROWS) and "░" * 20 in chart  # the top value fills the width
    svg = ET.fromstring(compare.scaling_svg(ROWS, "model", "cpu"))
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 2


def test_prefill_figures_from_both_engines(monkeypatch):
    """llama.cpp's S_PP column for one prompt; localbatch's prompt over its median TTFT."""
    import json
    import subprocess

    table = ("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
             "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
             "|   512 |      1 |    1 |    513 |    4.400 |   116.36 |    0.050 |    20.00 |    4.450 |   115.28 |\n")
    sweep = json.dumps({"sweep": [{"concurrency": 1, "ttft_ms_p50": 4000.0, "decode_tok_s": 25.0}]})
    outputs = iter([table, sweep])
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, next(outputs), ""))
    assert compare.prefill_llama_cpp("m.gguf", 512) == (116.36, 20.0)
    assert compare.batched_bench_rows(table)[0][2] == "1"
    assert compare.prefill_localbatch("m.gguf", 512, []) == (128.0, 25.0)


def test_decode_counts_the_steps_of_the_whole_batch(monkeypatch):
    """S_TG times sequences decoding together after every prompt is read: localbatch's side reads
    its full-batch rate, with the prefill budget off so that the batch forms (unless `extra` says)."""
    import json
    import subprocess

    seen = []
    sweep = json.dumps({"sweep": [{"concurrency": 1, "decode_tok_s": 9.0, "full_batch_tok_s": 10.0},
                                  {"concurrency": 16, "decode_tok_s": 50.0, "full_batch_tok_s": 110.0}]})
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0, sweep, ""))
    assert compare.run_localbatch("m.gguf", [1, 16], ["--itl-target-ms", "60"]) == {1: 10.0, 16: 110.0}
    cmd = seen[0]
    assert cmd[cmd.index("--itl-target-ms") + 1] == "0" and cmd[-2:] == ["--itl-target-ms", "60"]  # the last one counts


def test_a_prompt_length_row_takes_medians_and_per_round_ratios():
    row = compare.prefill_row(2048, [((100.0, 20.0), (150.0, 30.0)), ((80.0, 20.0), (160.0, 25.0)),
                                     ((90.0, 10.0), (99.0, 30.0))])
    assert (row["llama_cpp_tok_s"], row["localbatch_tok_s"], row["ratio"]) == (90.0, 150.0, 1.5)
    assert (row["localbatch_decode_tok_s"], row["decode_ratio"]) == (30.0, 1.5)
    assert row["localbatch_ttft_s"] == round(2048 / 150.0, 2)


def test_a_run_pairs_both_engines_per_concurrency(monkeypatch):
    """Rounds alternate which engine goes first; each concurrency's figure is the median of the
    rounds and its ratio the median of the rounds' ratios."""
    calls = []
    peer = iter([{1: 10.0, 4: 20.0}, {1: 20.0, 4: 40.0}, {1: 30.0, 4: 60.0}])
    ours = iter([{1: 15.0, 4: 30.0}, {1: 20.0, 4: 80.0}, {1: 60.0, 4: 60.0}])
    monkeypatch.setattr(compare, "run_llama_cpp", lambda binary, model, batches: calls.append("peer") or next(peer))
    monkeypatch.setattr(compare, "run_localbatch", lambda model, batches, extra: calls.append("ours") or next(ours))
    report = compare.run_compare("m.gguf", "bench-bin", [1, 4], [], 3, [])
    assert calls == ["peer", "ours", "ours", "peer", "peer", "ours"]
    one, four = report["rows"]
    assert (one["localbatch_tok_s"], one["llama_cpp_tok_s"], one["ratio"], one["round_ratios"]) == (20.0, 20.0, 1.5, [1.5, 1.0, 2.0])
    assert four["ratio"] == 1.5 and "prefill" not in report
    # The table divides the medians (20 / 20); the report keeps the median of the rounds' ratios.
    assert compare.format_report(report).splitlines()[2].rstrip().endswith("1.00x")
