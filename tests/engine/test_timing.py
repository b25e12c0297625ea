"""The one definition of TTFT / inter-token latency / tok/s that engine, TUI and HTTP client share."""

import pytest

from app.engine.core.timing import reply_timing


def test_no_token_yet_has_no_figures() -> None:
    t = reply_timing(10.0, None, None, 0)
    assert (t.ttft_s, t.itl_s, t.tokens_per_s) == (None, None, None)


def test_one_token_has_ttft_but_no_rate() -> None:
    t = reply_timing(10.0, 10.5, 10.5, 1)
    assert t.ttft_s == pytest.approx(0.5)
    assert t.itl_s is None and t.tokens_per_s is None


def test_rate_counts_the_gaps_after_the_first_token() -> None:
    t = reply_timing(10.0, 10.5, 11.5, 11)  # 10 gaps in one second
    assert t.itl_s == pytest.approx(0.1)
    assert t.tokens_per_s == pytest.approx(10.0)


def test_tokens_in_one_instant_have_no_rate() -> None:
    assert reply_timing(0.0, 1.0, 1.0, 3).tokens_per_s is None
