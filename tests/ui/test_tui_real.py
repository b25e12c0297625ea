"""The terminal app end to end on a real engine (a tiny random-weight model): load, open a second
tab, broadcast one prompt, both tabs decode in the same engine steps, replies are stored."""

from __future__ import annotations

import time
from pathlib import Path

from app.engine.api.async_engine import AsyncEngine
from app.ui.app import LocalbatchApp, TuiOptions
from app.ui.screen import ChatScreen
from app.ui.widgets import MessageView, PromptInput


async def test_broadcast_on_a_real_engine(tmp_path: Path, tiny_gguf_factory) -> None:
    model = tiny_gguf_factory("llama", context_length=512)
    config = tmp_path / "config.toml"
    # Long enough that the second tab's request (a frame later) joins the first one's decode.
    config.write_text("[sampling]\ntemperature = 0.0\nmax_tokens = 200\n")
    engines: list[AsyncEngine] = []

    def factory(progress, model_path, device, config):
        engines.append(AsyncEngine(str(model), device="cpu", dtype="float32", kv_cache_blocks=128, progress=progress))
        return engines[0]

    app = LocalbatchApp(factory, TuiOptions(data_dir=tmp_path / "data", config_path=config, poll_interval=0.05, tools=False))
    batch_sizes: list[int] = []
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + 60
            while not isinstance(app.screen, ChatScreen):
                assert time.monotonic() < deadline, "the model did not load"
                await pilot.pause(0.05)
            screen = app.screen
            await pilot.press("ctrl+n")
            while len(screen.panes()) < 2:
                await pilot.pause(0.02)
            screen.active_pane().query_one(PromptInput).insert("hello world")
            await pilot.press("ctrl+b")
            engine = engines[0]
            deadline = time.monotonic() + 60
            while True:
                await pilot.pause(0.01)
                batch_sizes.append(engine.stats().last_batch_size)
                done = all(not p.generating and len(p.session.messages) == 2 for p in screen.panes())
                if done:
                    break
                assert time.monotonic() < deadline, "replies did not finish"
            replies = []
            for pane in screen.panes():
                assert [m.role for m in pane.session.messages] == ["user", "assistant"]
                reply = pane.session.messages[1].content
                assert reply.strip()
                shown = list(pane.query(MessageView))[-1].markdown.source
                assert shown == reply  # the tab shows what was stored
                assert app.store.count_messages(pane.session.chat.id) == 2
                replies.append(reply)
            assert replies[0] == replies[1]  # greedy decoding of one prompt, batched or not
            # Both tabs ran in one step: the second prompt waits a step for the first one's blocks
            # (the same tokens), then decodes beside it with them served from the prefix cache.
            steps = [record.batch_size for record in engine.engine.metrics.window]
            assert max(steps + batch_sizes) == 2, (steps, batch_sizes)
            assert engine.stats().prefix_cache_hit_rate > 0
            assert engine.stats().num_blocks_used == 0
            await pilot.press("ctrl+q")
        assert app.engine is None  # quitting closed it
    finally:
        for engine in engines:
            engine.close()
