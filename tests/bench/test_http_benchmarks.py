"""`bench serve` and `bench complete`, their clients against the HTTP server on the fake engine:
the streamed events are timed, the follow-ups read back the server's cache figures."""

from __future__ import annotations

from pathlib import Path

from app.bench.complete import Target, format_report, run_complete
from app.bench.datasets import FollowUps
from app.bench.serve import run_serve
from app.bench.stream import Load
from tests.support.fake_engine import FakeEngine, ServerThread


def test_streaming_levels_time_every_text_event():
    with ServerThread(FakeEngine(max_model_len=256)) as srv:
        for endpoint in ("completions", "chat"):
            load = Load(endpoint=endpoint, prompt_len=8, max_tokens=6, max_token_id=250)
            report = run_serve(srv.url, [1, 2], 2, load, log=lambda _: None)
            assert report["endpoint"] == endpoint and [r["concurrency"] for r in report["levels"]] == [1, 2]
            for row in report["levels"]:
                assert row["requests"] == 2 * row["concurrency"] and row["output_tok_s"] > 0
                assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]


def test_completion_follow_ups_against_a_fim_model(tmp_path):
    source = tmp_path / "edited.py"
    source.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(60)))
    followups = FollowUps(file=source, cursor_line=61, prefix_lines=40, suffix_lines=10, extra_file=None)
    lines: list[str] = []
    with ServerThread(FakeEngine(fim=True, max_model_len=4096, num_blocks=1024)) as srv:
        report = run_complete([Target("fake", srv.url)], followups, 4, prompts=2, n_predict=4, log=lines.append)
    (server,) = report["servers"]
    assert report["followups"] == 3 and len(lines) == 1 and "contents" not in server
    assert server["first_ttft_s"] > 0 and server["followup_ttft_p50_s"] > 0 and server["followup_latency_p50_s"] > 0
    assert len(server["cache_n"]) == 4 and server["cache_n"][1] > 0  # the edit keeps the start cached
    assert all(isinstance(n, int) and n > 0 for n in server["prompt_n"])
    assert "follow-ups TTFT p50" in format_report(report) and Path(report["file"]) == source


def test_the_command_line_runs_both_against_a_running_server(tmp_path, capsys):
    import json

    from app.cli import main

    source = tmp_path / "edited.py"
    source.write_text("".join(f"    v{i} = {i}\n" for i in range(80)))
    with ServerThread(FakeEngine(fim=True, max_model_len=4096, num_blocks=1024)) as srv:
        assert main(["bench", "complete", "--url", srv.url, "--followups", "1", "--file", str(source),
                     "--cursor-line", "40", "--n-predict", "3", "--json", str(tmp_path / "c.json")]) == 0
        assert main(["bench", "serve", "--url", srv.url, "--concurrency", "1", "--rounds", "1", "--max-tokens", "4",
                     "--prompt-len", "4", "--max-token-id", "250", "--json", "-"]) == 0
    complete = json.loads((tmp_path / "c.json").read_text())
    assert complete["benchmark"] == "complete" and complete["servers"][0]["server"] == "server"
    assert complete["settings"]["file"] == str(source)
    serve = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # --json -: the record alone on stdout
    assert serve["benchmark"] == "serve" and serve["levels"][0]["concurrency"] == 1
