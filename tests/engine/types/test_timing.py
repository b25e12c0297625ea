"""The one definition of TTFT / inter-token latency / tok/s that engine, TUI and HTTP client share."""

import pytest

from app.engine.types.timing import reply_timing


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



def test_kv_bytes_read_caps_sliding_window_layers() -> None:
    """Gemma 3's shape: 5 of every 6 layers read at most their 512-token window."""
    from dataclasses import replace

    from app.engine.gguf.model_config import ModelConfig

    cfg = ModelConfig(arch="gemma3", name="t", vocab_size=32, hidden_size=640, num_layers=18, num_heads=4,
                      num_kv_heads=1, head_dim=256, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6,
                      rope_style="neox", max_position=8192, sliding_window=512, sliding_window_pattern=6)
    per_layer_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    assert cfg.kv_bytes_read([3000], 2) == per_layer_token * (15 * 512 + 3 * 3000)
    assert cfg.kv_bytes_read([100, 3000], 2) == per_layer_token * (18 * 100 + 15 * 512 + 3 * 3000)
    full = replace(cfg, sliding_window=None)
    assert full.kv_bytes_read([3000], 2) == per_layer_token * 18 * 3000
