"""Speculative decoding in the app: the throughput panel shows its yield, the command palette turns
it on and off through `EngineClient.set_speculation`, and /metrics counts drafts."""

from __future__ import annotations

from pathlib import Path

from app.engine.types.outputs import EngineStats, SpecStats
from app.server.prometheus import _engine_lines
from app.ui.panels import render_step_line
from tests.ui.test_tui import SIZE, chat_screen, make_app

NGRAM = SpecStats("ngram", "", True, 120, 90, 0.78, 4.1)


def test_throughput_panel_shows_what_speculation_yields() -> None:
    assert "spec" not in render_step_line(EngineStats())
    assert "spec 78% kept · 4.1 tok/seq-step" in render_step_line(EngineStats(speculative=NGRAM))
    off = SpecStats("ngram+draft", "qwen2.5-coder-0.5b-instruct", False, 0, 0, 0.0, 1.0)
    assert "spec ngram+draft: off (ctrl+p)" in render_step_line(EngineStats(speculative=off))
    fresh = SpecStats("ngram", "", True, 0, 0, 0.0, 1.0)
    assert "no drafts yet" in render_step_line(EngineStats(speculative=fresh))
    for stats in (NGRAM, off, fresh):
        for line in render_step_line(EngineStats(speculative=stats)).splitlines():
            assert len(line) <= 36  # the panel's width


def test_metrics_count_drafted_and_kept_tokens() -> None:
    text = "\n".join(_engine_lines(EngineStats(speculative=NGRAM), {}))
    assert "localbatch:spec_decode_num_draft_tokens_total 120" in text
    assert "localbatch:spec_decode_num_accepted_tokens_total 90" in text
    assert "spec_decode" not in "\n".join(_engine_lines(EngineStats(), {}))


async def test_palette_toggles_speculation(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert not [c for c in app.get_system_commands(screen) if "Speculative" in c.title]  # not configured
        engine.frozen_stats = EngineStats(speculative=NGRAM)
        (command,) = [c for c in app.get_system_commands(screen) if "Speculative" in c.title]
        assert command.title == "Speculative decoding: turn off"
        command.callback()
        await pilot.pause()
        assert engine.speculation_enabled is False
        # The fake engine has no speculator: the app says so instead of pretending.
        assert any("without --speculative-config" in n.message for n in app._notifications)
