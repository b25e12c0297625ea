"""A/B runs seconds apart: the order switches each round; rows report medians of the pairs' ratios."""

from __future__ import annotations

from app.bench.paired import Pair, Turn, alternate, format_rows, summary_row


def test_alternate_switches_which_side_goes_first():
    calls: list[str] = []
    seen: list[tuple[int, str, str]] = []
    pairs = alternate(lambda: calls.append("a") or "A", lambda: calls.append("b") or "B", 4,
                      on_pair=lambda r, a, b: seen.append((r, a, b)))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert pairs == [("A", "B")] * 4 and [r for r, _, _ in seen] == [0, 1, 2, 3]


def test_summary_row_takes_medians_of_the_pairs():
    def pair(target: float, engine: float, gap: float) -> Pair:
        return Pair(Turn(target, {"step_ms": 5.0, "step_gap_us": gap}), Turn(engine, {"step_ms": 4.0, "step_gap_us": 40.0}))

    row = summary_row("app, 1 tabs", [pair(90.0, 100.0, 100.0), pair(50.0, 100.0, 300.0), pair(95.0, 100.0, 200.0)])
    assert (row["tok_s"], row["engine_tok_s"], row["ratio"]) == (90.0, 100.0, 0.9)
    assert row["ratios"] == [0.9, 0.5, 0.95]
    assert "steps 5.00 against the engine's 4.00 ms, between steps 200 against 40 us" in row["note"]
    table = format_rows([row, {"where": "llama-server", "tok_s": 80.0, "engine_tok_s": None, "ratio": None, "note": "x"}])
    assert "| app, 1 tabs | 90.0 | 100.0 | 0.90 |" in table and "| llama-server | 80.0 | - | - | x |" in table
