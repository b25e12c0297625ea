"""Switching models inside the app: the picker, the reload with progress, chats kept, each reply
recording its model, the endpoint following the switch, and a failed load bringing the old model
back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from textual.widgets import Input, OptionList

from app.engine.types.errors import LocalbatchError
from app.ui.app import MODEL_KEY, LocalbatchApp, TuiOptions
from app.ui.dialogs import ModelPicker
from app.ui.screen import ChatScreen
from app.ui.store import ChatStore
from tests.support.fake_engine import FakeEngine, echo_reply
from tests.ui.test_tui import SIZE, free_port, idle, type_and_send, until


class Models:
    """An engine factory over named fake models; "broken" fails to load like a bad GGUF."""

    def __init__(self) -> None:
        self.loaded: list[str | None] = []
        self.engines: list[FakeEngine] = []

    def __call__(self, progress: Any, model: str | None, device: str | None, config: Any) -> FakeEngine:
        self.loaded.append(model)
        if model == "broken":
            raise LocalbatchError("broken: not a GGUF file (bad magic)")
        engine = FakeEngine(model_name=model or "default-model", max_model_len=4096, script=echo_reply)
        self.engines.append(engine)
        return engine


def _app(tmp_path: Path, models: Models, config: str = "") -> LocalbatchApp:
    config_path = tmp_path / "config.toml"
    config_path.write_text(config)
    return LocalbatchApp(models, TuiOptions(data_dir=tmp_path / "data", config_path=config_path, poll_interval=0,
                                                  tools=False))


def _entries(monkeypatch: Any) -> None:
    from app.engine.gguf import catalog

    entries = [("model-b", "the other model", True), ("not-pulled", "a model to pull", False)]
    monkeypatch.setattr(catalog, "picker_entries", lambda: entries)


async def _chat(pilot: Any, model_name: str) -> ChatScreen:
    def ready() -> bool:
        screen = pilot.app.screen
        return isinstance(screen, ChatScreen) and screen.info.model_name == model_name

    await until(pilot, ready, message=lambda: repr(pilot.app.screen))
    await pilot.pause()
    return pilot.app.screen


async def _pick(pilot: Any, name: str) -> None:
    await pilot.press("f5")
    await until(pilot, lambda: isinstance(pilot.app.screen, ModelPicker))
    options = pilot.app.screen.query_one(OptionList)
    index = next(i for i in range(options.option_count) if options.get_option_at_index(i).id == name)
    options.highlighted = index
    await pilot.press("enter")


async def test_switch_keeps_chats_records_models_and_remembers_the_choice(tmp_path: Path, monkeypatch: Any) -> None:
    _entries(monkeypatch)
    models = Models()
    app = _app(tmp_path, models)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _chat(pilot, "default-model")
        await type_and_send(pilot, "first question")
        await idle(pilot, screen)
        await pilot.press("f5")
        await until(pilot, lambda: isinstance(pilot.app.screen, ModelPicker))
        labels = [str(o.prompt) for o in pilot.app.screen.query_one(OptionList).options]
        assert "not pulled" in labels[1] and "enter pulls it" in labels[1]
        assert not pilot.app.screen.query_one(OptionList).get_option_at_index(1).disabled
        await pilot.press("escape")
        await _pick(pilot, "model-b")
        screen = await _chat(pilot, "model-b")
        assert models.engines[0].closed and app.engine is models.engines[1]
        assert "model-b" in str(app.screen.sub_title)
        pane = screen.active_pane()
        assert [m.content for m in pane.session.messages][0] == "first question"  # the chat came along
        await type_and_send(pilot, "second question")
        await idle(pilot, screen)
        replies = [m for m in pane.session.messages if m.role == "assistant"]
        assert [m.model for m in replies] == ["default-model", "model-b"]
        assert app.store.get_meta(MODEL_KEY) == "model-b"
    models2 = Models()
    async with _app(tmp_path, models2).run_test(size=SIZE) as pilot:  # the next start loads it again
        await _chat(pilot, "model-b")
        assert models2.loaded == ["model-b"]


async def test_a_failed_load_brings_the_previous_model_back(tmp_path: Path, monkeypatch: Any) -> None:
    models = Models()
    app = _app(tmp_path, models)
    async with app.run_test(size=SIZE) as pilot:
        await _chat(pilot, "default-model")
        await pilot.press("f5")
        await until(pilot, lambda: isinstance(pilot.app.screen, ModelPicker))
        path = pilot.app.screen.query_one(Input)
        path.focus()
        path.value = "broken"
        await pilot.press("enter")
        await until(pilot, lambda: models.loaded == [None, "broken", None], message=lambda: str(models.loaded))
        await _chat(pilot, "default-model")
        assert any("bad magic" in str(n.message) for n in app._notifications)
        assert app.store.get_meta(MODEL_KEY) is None


async def test_a_remembered_model_that_is_gone_falls_back_to_the_default(tmp_path: Path) -> None:
    store = ChatStore.in_dir(tmp_path / "data")
    store.set_meta(MODEL_KEY, "broken")
    store.close()
    models = Models()
    async with _app(tmp_path, models).run_test(size=SIZE) as pilot:
        await _chat(pilot, "default-model")
        assert models.loaded == ["broken", None]


async def test_the_endpoint_serves_the_new_model_after_a_switch(tmp_path: Path, monkeypatch: Any) -> None:
    _entries(monkeypatch)
    port = free_port()
    app = _app(tmp_path, Models(), config=f"[server]\nport = {port}\n")
    async with app.run_test(size=SIZE) as pilot:
        screen = await _chat(pilot, "default-model")
        await pilot.press("f9")
        await until(pilot, lambda: screen.endpoint.running and "starting" not in screen.sidebar.endpoint_note)
        await _pick(pilot, "model-b")
        screen = await _chat(pilot, "model-b")
        await until(pilot, lambda: screen.endpoint.running and "starting" not in screen.sidebar.endpoint_note)
        async with httpx.AsyncClient() as client:
            resp = await client.get(f"http://127.0.0.1:{port}/v1/models")
        assert resp.json()["data"][0]["id"] == "model-b"
        await pilot.press("f9")
        await until(pilot, lambda: not screen.endpoint.running)


async def test_the_picker_pulls_a_model_while_the_current_one_serves(tmp_path: Path, monkeypatch: Any) -> None:
    """Choosing an unpulled entry pulls it in a thread: the side panel shows its progress, replies
    keep streaming from the current model, and a note says when it is done; a failed pull says why."""
    import threading

    from textual.widgets import Static

    from app.engine.gguf import pull as pull_module

    _entries(monkeypatch)
    release, calls = threading.Event(), []

    def fake_pull(name: str, progress: Any = None) -> Path:
        calls.append(name)
        progress("downloading not-pulled: part 3/6, 200 / 491 MB", 0.4)
        if not release.wait(10):
            raise AssertionError("never released")
        if len(calls) > 1:
            raise LocalbatchError("part 2/6 (x==1): checksum mismatch")
        return tmp_path / "x.gguf"

    monkeypatch.setattr(pull_module, "pull", fake_pull)
    models = Models()
    app = _app(tmp_path, models)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _chat(pilot, "default-model")
        await _pick(pilot, "not-pulled")
        await until(pilot, lambda: "40%" in str(screen.query_one("#pull-status", Static).render()))
        assert screen.query_one("#pull-status", Static).display
        await type_and_send(pilot, "still here?")  # the current model keeps serving meanwhile
        await idle(pilot, screen)
        assert [m.role for m in screen.active_pane().session.messages][-1] == "assistant"
        assert app.engine is models.engines[0] and models.loaded == [None]
        release.set()
        await until(pilot, lambda: app.pulling.done)
        await until(pilot, lambda: not screen.query_one("#pull-status", Static).display)
        notes = [n.message for n in app._notifications]
        assert any("not-pulled is pulled" in m for m in notes), notes
        release.clear()
        await _pick(pilot, "not-pulled")
        release.set()
        await until(pilot, lambda: app.pulling.done)
        await pilot.pause()
        assert any("Could not pull not-pulled: part 2/6" in n.message for n in app._notifications)
