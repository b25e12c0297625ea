"""The app benchmarks' own parts (benchmarks/ui/): what the benchmarked app is configured with, and
the paced fake engine's hand-off, which must hold deltas as the real engine does."""

from __future__ import annotations

import asyncio
import importlib
import time

from app.engine.types.sampling_params import SamplingParams
from app.tools.config import read_tools_config
from app.ui.user_config import parse_config

# The research scripts are not a package of the product: imported as the registry imports them.
tmux = importlib.import_module("benchmarks.ui.tmux")
ui_cost = importlib.import_module("benchmarks.ui.ui_cost")


def test_the_benchmarked_app_offers_no_tools_unless_asked(tmp_path):
    """Offered tools put their prompt before the question and constrain the reply: the app would
    decode other steps than the engine alone."""
    import tomllib

    for tools in (False, True):
        path = tmp_path / f"config-{tools}.toml"
        path.write_text(tmux.app_config(384, tools))
        config = parse_config(tomllib.loads(path.read_text()), path)
        assert config.sampling.temperature == 0.0 and config.sampling.max_tokens == 384
        assert read_tools_config(path, None).builtin is tools


def test_the_paced_engine_holds_deltas_as_the_real_one_does():
    """At a few ms a step the deltas reach the app's loop in batches (the first token and the last
    delta at once), merged into one, and every token arrives."""
    tokens = ui_cost.reply_tokens()[:60]
    engine = ui_cost.SteppedElsewhere(ui_cost.FakeEngine(model_name="m", max_model_len=4096, step_delay=0.002,
                                                         script=lambda _p: list(tokens)))

    async def consume() -> list:
        deltas, started = [], time.monotonic()
        async for delta in engine.stream("hi", SamplingParams(max_tokens=len(tokens)), "r1", max_delay_s=0.05):
            deltas.append((time.monotonic() - started, delta))
        return deltas

    try:
        deltas = asyncio.run(consume())
    finally:
        engine.close()
    received = [d for _, d in deltas]
    assert "".join(d.text for d in received) == "".join(tokens)
    assert received[-1].finish_reason is not None and received[-1].num_output_tokens == len(tokens)
    assert len(received[0].token_ids) == 1  # the first token alone, at once
    assert len(received) < len(tokens) // 3  # held: far fewer hand-offs than steps
