"""The terminal app, driven with Textual's Pilot over a fake engine: start-up, tabs, streaming,
stop, broadcast, persistence, export, settings, keymap, panels, the embedded endpoint, the remote
backend, and a snapshot of the main screen."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.widgets import Input, Markdown, Static, TabbedContent, TabPane

from app.clients.prometheus_text import parse_metrics
from app.clients.remote import RemoteEngine, RemoteError
from app.engine.types.errors import GGUFError, QueueFullError, RequestError
from app.engine.types.outputs import EngineStats, RequestStats
from app.engine.types.sampling_params import SamplingParams
from app.ui.app import LocalbatchApp, TuiOptions
from app.ui.dialogs import ConfirmDialog, RenameDialog
from app.ui.export import chat_to_markdown
from app.ui.loading import LoadingScreen
from app.ui.panels import (
    Owner,
    PanelText,
    ThroughputHistory,
    bar_cells,
    kv_segments,
    render_kv,
)
from app.ui.screen import ChatScreen
from app.ui.store import SCHEMA_VERSION, ChatStore, StoreError
from app.ui.user_config import ChatSettings, ConfigError, load_config
from app.ui.widgets import PromptInput
from tests.support.fake_engine import FakeEngine, ServerThread, echo_reply

SIZE = (120, 40)


# --- helpers ------------------------------------------------------------------------------------


def decoding(request_id: str, *, prompt: int, output: int, blocks: int, ttft: float | None = None,
             itl: float | None = None, rate: float | None = None) -> RequestStats:
    """A decoding request's stats row, as the engine reports it."""
    return RequestStats(request_id=request_id, status="decode", num_prompt_tokens=prompt, num_output_tokens=output,
                        num_blocks=blocks, num_cached_tokens=0, ttft_s=ttft, itl_s=itl, tokens_per_s=rate)


def chat_engine(**settings: Any) -> FakeEngine:
    """The fake engine as these tests know it: a quantized model's figures, echoed replies."""
    return FakeEngine(**{"model_name": "fake-model-q4", "max_model_len": 4096, "script": echo_reply, **settings})


def make_app(tmp_path: Path, engine: Any = None, config: str = "", **options: Any) -> tuple[LocalbatchApp, Any]:
    """An app on a fake engine with its own data dir and config file (never the user's)."""
    engine = engine if engine is not None else chat_engine()
    config_path = tmp_path / "config.toml"
    config_path.write_text(config)
    options.setdefault("poll_interval", 0)
    options.setdefault("tools", False)  # no MCP server subprocesses unless a test asks for them
    app = LocalbatchApp(lambda progress, model, device, config: engine,
                        TuiOptions(data_dir=tmp_path / "data", config_path=config_path, **options))
    return app, engine


async def until(pilot: Any, condition: Callable[[], bool], timeout: float = 5.0,
                message: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time {message()}")
        await pilot.pause(0.01)


async def chat_screen(pilot: Any) -> ChatScreen:
    await until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
    await pilot.pause()
    return pilot.app.screen


async def type_and_send(pilot: Any, text: str) -> None:
    pilot.app.screen.active_pane().query_one(PromptInput).insert(text)
    await pilot.press("enter")


async def idle(pilot: Any, screen: ChatScreen) -> None:
    await until(pilot, lambda: not any(p.generating for p in screen.panes()))
    await pilot.pause()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- start-up -----------------------------------------------------------------------------------


async def test_start_shows_model_device_dtype_and_kv_budget(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        info = str(screen.query_one("#model-info", Static).render())
        assert "fake-model-q4 · cpu · bfloat16" in info
        assert "context 4,096 tokens" in info
        assert "KV budget 8,192 tokens · 144.0 MiB" in info  # 512 blocks x 16 x 18 KiB
        assert [p.session.chat.title for p in screen.panes()] == ["Chat 1"]
        assert isinstance(app.focused, PromptInput)


async def test_loading_progress_then_failure_shows_error_and_model_hint(tmp_path: Path) -> None:
    release = threading.Event()

    def factory(progress: Any, model: Any, device: Any, config: Any) -> Any:
        progress("assembling embedded model", 1.0)
        progress("loading tensors", 0.5)
        release.wait(5)
        raise GGUFError("not a GGUF file: /models/x.bin")

    app = LocalbatchApp(factory, TuiOptions(data_dir=tmp_path, config_path=_empty_config(tmp_path), model="/models/x.bin", tools=False))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LoadingScreen))
        screen = app.screen
        stages = screen.query_one("#loading-stages", Static)
        await until(pilot, lambda: "loading tensors  50%" in str(stages.render()))
        assert "✓ assembling embedded model" in str(stages.render())
        release.set()
        await until(pilot, lambda: screen.error is not None)
        shown = str(screen.query_one("#loading-error", Static).render())
        assert "not a GGUF file: /models/x.bin" in shown
        assert "localbatch --model PATH.gguf" in shown


def _empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


# --- chatting -----------------------------------------------------------------------------------


async def test_send_streams_reply_into_markdown_and_commits_it(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.01))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        engine.paused = True
        await type_and_send(pilot, "tell me about paged attention")
        assert pane.prompt.text == ""
        await until(pilot, lambda: bool(engine.live_request_ids()))
        engine.paused = False
        await until(pilot, lambda: pane.session.reply.metrics.num_tokens >= 2)
        assert pane.generating  # caught mid-stream (7 tokens, 10 ms apart)
        await idle(pilot, screen)
        reply = "Reply to: tell me about paged attention"
        assert pane.query(Markdown).last().source == reply
        stored = app.store.messages(pane.session.chat.id)
        assert [(m.role, m.content) for m in stored] == [("user", "tell me about paged attention"), ("assistant", reply)]
        assert stored[1].finish_reason == "stop" and stored[1].num_tokens == 7
        assert stored[1].ttft_s is not None and stored[1].tokens_per_s > 0
        assert pane.session.chat.title == "tell me about paged attenti…"  # the first prompt names the chat
        prompt, params, request_id = engine.submitted[0]
        assert prompt == [{"role": "user", "content": "tell me about paged attention"}]
        assert params.temperature == 0.7 and params.max_tokens == 512
        assert request_id.startswith(f"chat{pane.session.chat.id}-")


async def test_ctrl_j_inserts_newline_instead_of_sending(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert screen.active_pane().prompt.text == "a\nb"
        assert not engine.submitted
        await pilot.press("enter")
        await idle(pilot, screen)
        assert engine.submitted[0].prompt == [{"role": "user", "content": "a\nb"}]


async def test_escape_stops_generation_and_commits_partial_reply(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.005))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        engine.hold_after = 2
        await type_and_send(pilot, "one two three four five six")
        await until(pilot, lambda: pane.session.reply is not None and pane.session.reply.metrics.num_tokens >= 2)
        request_id = pane.session.request_id
        await pilot.press("escape")
        await idle(pilot, screen)
        assert request_id in engine.aborted and not engine.live_request_ids()
        last = app.store.messages(pane.session.chat.id)[-1]
        assert last.role == "assistant" and last.finish_reason == "abort"
        assert last.content.startswith("Reply") and len(last.content) < len("Reply to: one two three four five six")
        assert "stopped" in str(pane.query(".meta").last().render())
        engine.hold_after = None
        await pilot.press("ctrl+r")  # regenerate replaces the stopped reply
        await idle(pilot, screen)
        messages = app.store.messages(pane.session.chat.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[-1].content == "Reply to: one two three four five six"
        assert engine.submitted[1].prompt == engine.submitted[0].prompt


async def test_rejected_request_shows_error_and_regenerate_retries(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        engine.fail_next = QueueFullError("the waiting queue is full (256 requests); retry later")
        await type_and_send(pilot, "busy?")
        await idle(pilot, screen)
        assert "error: the waiting queue is full" in str(pane.query(".meta").last().render())
        assert [m.role for m in app.store.messages(pane.session.chat.id)] == ["user"]  # errors are not stored
        await pilot.press("ctrl+r")
        await idle(pilot, screen)
        assert not pane.query(".failed")
        assert [m.content for m in app.store.messages(pane.session.chat.id)] == ["busy?", "Reply to: busy?"]


async def test_tabs_open_switch_close_and_delete_with_confirm(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        tabs = screen.query_one(TabbedContent)
        first = screen.active_pane()
        await type_and_send(pilot, "keep me")
        await idle(pilot, screen)
        await pilot.press("ctrl+n", "ctrl+n")
        await until(pilot, lambda: len(screen.panes()) == 3)
        ids = [p.id for p in screen.panes()]
        assert tabs.active == ids[2] and isinstance(app.focused, PromptInput)
        await pilot.press("alt+left")
        assert tabs.active == ids[1]
        await pilot.press("ctrl+pagedown", "ctrl+pagedown")
        assert tabs.active == ids[0]
        await pilot.press("ctrl+pageup")
        assert tabs.active == ids[2]
        await pilot.press("ctrl+w")  # an empty chat closes without asking
        await until(pilot, lambda: len(screen.panes()) == 2)
        await pilot.press("alt+left")
        assert tabs.active == first.id
        await pilot.press("ctrl+delete")  # deleting one with messages: confirm first
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        assert len(screen.panes()) == 2 and app.store.count_messages(first.session.chat.id) == 2
        await pilot.press("ctrl+delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#confirm")
        await until(pilot, lambda: len(screen.panes()) == 1)
        assert first.session.chat.id not in [c.id for c in app.store.chats()]
        assert app.store.count_messages(first.session.chat.id) == 0


async def test_a_focus_event_arriving_after_a_tab_switch_does_not_switch_back(tmp_path: Path) -> None:
    """Textual's tabs follow focus: the focus event of a tab just left, handled after the switch
    (a slow UI thread), switched back to it, and a reply meant to wait for a hidden tab rendered."""
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await screen.new_tab()
        first, second = screen.panes()
        tabs = screen.query_one(TabbedContent)
        tabs.active = first.id
        await pilot.pause()
        assert app.focused is first.prompt
        tabs.active = second.id
        first.post_message(TabPane.Focused(first))  # the first tab's focus, arriving late
        for _ in range(3):
            await pilot.pause()
        assert tabs.active == second.id and not first.display and app.focused is second.prompt


async def test_broadcast_decodes_in_every_tab_at_once(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.01), poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        for _ in range(3):
            await pilot.press("ctrl+n")
        await until(pilot, lambda: len(screen.panes()) == 4)
        screen.active_pane().query_one(PromptInput).insert("compare notes")
        engine.hold_after = 2
        await pilot.press("ctrl+b")
        await until(pilot, lambda: len(engine.live_request_ids()) == 4)
        await pilot.pause(0.1)  # a few panel polls
        body = str(screen.query_one("#kv-body", Static).render())
        assert all(p.session.chat.title in body for p in screen.panes())  # each tab holds KV blocks
        assert "batch 4 seq" in str(screen.query_one("#tp-steps", Static).render())
        engine.hold_after = None
        await idle(pilot, screen)
        assert engine.max_concurrent == 4
        for pane in screen.panes():
            assert [m.content for m in pane.session.messages] == ["compare notes", "Reply to: compare notes"]
        assert screen.active_pane().prompt.text == ""


async def test_a_broadcast_to_a_lone_tab_is_a_plain_send(tmp_path: Path, monkeypatch: Any) -> None:
    """No toast for it: the reply shows the prompt went out. A busy lone tab still says why not."""
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.01))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        toasts: list[str] = []
        monkeypatch.setattr(screen, "notify", lambda message, **kw: toasts.append(message))
        screen.active_pane().query_one(PromptInput).insert("hello")
        engine.hold_after = 2
        await pilot.press("ctrl+b")
        await until(pilot, lambda: len(engine.live_request_ids()) == 1)
        assert toasts == []
        screen.active_pane().query_one(PromptInput).insert("again")
        await pilot.press("ctrl+b")
        assert toasts == ["Broadcast to 0 tabs; 1 busy, skipped"]
        engine.hold_after = None
        await idle(pilot, screen)


async def test_restart_restores_tabs_messages_settings_and_active_tab(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await type_and_send(pilot, "first question")
        await idle(pilot, screen)
        await pilot.press("f2")
        await until(pilot, lambda: isinstance(app.screen, RenameDialog))
        app.screen.query_one(Input).value = "Renamed chat"
        await pilot.press("enter")
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(screen.panes()) == 2)
        second = screen.active_pane()
        await pilot.press("f3")
        form = second.query_one(".settings-form")
        form.query_one(".setting.temperature", Input).value = "0.2"
        form.query_one(".setting.seed", Input).value = "7"
        await pilot.pause()
        await pilot.press("f3")  # hides the form, focus back in the prompt
        assert isinstance(app.focused, PromptInput)
        await type_and_send(pilot, "second question")
        await idle(pilot, screen)
        await pilot.press("ctrl+q")
    assert app.return_code == 0

    app2, engine2 = make_app(tmp_path)
    async with app2.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        panes = screen.panes()
        assert [p.session.chat.title for p in panes] == ["Renamed chat", "second question"]
        assert [m.content for m in panes[0].session.messages] == ["first question", "Reply to: first question"]
        assert screen.active_pane() is panes[1]
        assert panes[1].session.chat.settings == ChatSettings(temperature=0.2, top_p=0.95, max_tokens=512, seed=7)
        assert len(panes[0].query(Markdown)) == 0  # a hidden tab mounts its history when shown
        await type_and_send(pilot, "and again")
        await idle(pilot, screen)
        params = engine2.submitted[0].params
        assert (params.temperature, params.seed) == (0.2, 7)
        assert [m["content"] for m in engine2.submitted[0].prompt] == ["second question", "Reply to: second question", "and again"]
        screen.query_one(TabbedContent).active = panes[0].id
        await until(pilot, lambda: len(panes[0].query(Markdown)) == 1)  # restored reply rendered


async def test_settings_form_rejects_invalid_values_and_system_prompt_is_sent(tmp_path: Path) -> None:
    config = 'system_prompt = "Be terse."\ntheme = "nord"\n[sampling]\ntemperature = 0.5\n'
    app, engine = make_app(tmp_path, config=config)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert app.theme == "nord"
        await pilot.press("ctrl+n")  # new chats take the config's system prompt and sampling
        await until(pilot, lambda: len(screen.panes()) == 2)
        pane = screen.active_pane()
        assert pane.session.chat.system_prompt == "Be terse." and pane.session.chat.settings.temperature == 0.5
        await pilot.press("f3")
        form = pane.query_one(".settings-form")
        form.query_one(".setting.top_p", Input).value = "2"
        await pilot.pause()
        assert "top_p" in str(form.query_one(".settings-error").render())
        assert app.store.chat(pane.session.chat.id).settings.top_p == 0.95
        form.query_one(".setting.top_p", Input).value = "0.5"
        await pilot.pause()
        assert str(form.query_one(".settings-error").render()) == ""
        assert app.store.chat(pane.session.chat.id).settings.top_p == 0.5
        await pilot.press("f3")
        await type_and_send(pilot, "hi")
        await idle(pilot, screen)
        assert engine.submitted[0].prompt[0] == {"role": "system", "content": "Be terse."}
        assert engine.submitted[0].params.top_p == 0.5


async def test_export_writes_markdown(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await type_and_send(pilot, "export me")
        await idle(pilot, screen)
        await pilot.press("f4")
        await pilot.pause()
        pane = screen.active_pane()
        path = tmp_path / "data" / "exports" / f"export-me-{pane.session.chat.id}.md"
        text = path.read_text()
        assert text.startswith("# export me\n")
        assert "model fake-model-q4 · temperature 0.7" in text
        assert "## User\n\nexport me\n\n## Assistant\n\nReply to: export me\n" in text


async def test_keymap_from_config_remaps_bindings_and_palette_lists_actions(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path, config='[keymap]\nnew_tab = "ctrl+t"\n')
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert len(screen.panes()) == 1
        await pilot.press("ctrl+t")
        await until(pilot, lambda: len(screen.panes()) == 2)
        commands = {c.title: c.help for c in app.get_system_commands(screen)}
        for title in ("Send", "New chat", "Close tab", "Delete chat", "Chats", "Search chats", "Next tab",
                      "Previous tab", "Stop", "Regenerate", "Rename", "Broadcast", "Settings", "Export", "Endpoint"):
            assert title in commands
        assert "(ctrl+t)" in commands["New chat"]


async def held_reply(pilot, engine: FakeEngine, text: str):
    """The chat screen with `text` sent and its reply held before its first token (the engine
    paused): (screen, the active pane)."""
    screen = await chat_screen(pilot)
    engine.paused = True
    await type_and_send(pilot, text)
    await until(pilot, lambda: bool(engine.live_request_ids()))
    return screen, screen.active_pane()


async def test_panels_show_tabs_api_requests_cached_blocks_and_waiting_queue(tmp_path: Path) -> None:
    engine = chat_engine(step_delay=0.005)
    app, _ = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        screen, pane = await held_reply(pilot, engine, "hold on")
        live = decoding(pane.session.request_id, prompt=10, output=20, blocks=2, ttft=0.05, itl=0.01, rate=31.5)
        api = decoding("chatcmpl-1", prompt=100, output=50, blocks=10, ttft=0.2, itl=0.02, rate=12.0)
        engine.frozen_stats = EngineStats(
            num_running=2, num_waiting=3, waiting_for="turn", num_blocks_total=100, num_blocks_used=12,
            num_blocks_cached_free=5,
            block_size=16, kv_bytes_per_token=18432, decode_tokens_per_s=43.5, prefill_tokens_per_s=1250.0,
            last_batch_size=2, last_num_tokens=2, last_step_time_s=0.0412, num_steps=99, requests=(live, api),
        )
        screen.poll_stats()
        await pilot.pause()
        kv = str(screen.query_one("#kv-body", Static).render())
        assert "used 12 / 100 blocks (12%)" in kv
        assert "hold on" in kv and "API (1 req)" in kv and "cached prefix (free)" in kv
        assert "1,408 more tokens fit" in kv  # (100 - 12) * 16
        assert "18.0 KiB/token" in kv
        assert "3 waiting: queued behind prompts" in kv
        rates = str(screen.query_one("#tp-rates", Static).render())
        assert "31.5" in rates and "50 ms" in rates and "API (1 req)" in rates
        steps = str(screen.query_one("#tp-steps", Static).render())
        assert "batch 2 seq" in steps and "step 41 ms" in steps
        engine.frozen_stats = None
        engine.paused = False
        await idle(pilot, screen)


async def test_a_long_prompt_shows_how_far_it_is_read_and_the_time_left(tmp_path: Path) -> None:
    """Under the coming reply: the prompt's progress at the engine's prefill rate, gone at the first token."""
    from dataclasses import replace

    from app.ui.widgets import MessageView

    engine = chat_engine(step_delay=0.005)
    app, _ = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        screen, pane = await held_reply(pilot, engine, "a pasted file")
        reading = replace(decoding(pane.session.request_id, prompt=4096, output=0, blocks=256), status="prefill",
                          num_computed_tokens=1536)
        engine.frozen_stats = EngineStats(prefill_tokens_per_s=80.0, requests=(reading,))
        screen.poll_stats()
        await pilot.pause()
        reply = list(pane.query(MessageView))[-1]
        meta = str(reply.query_one(".meta").render())
        assert "reading 1,536 / 4,096 tokens · ~32 s left" in meta
        engine.frozen_stats = EngineStats(requests=(replace(reading, status="waiting", num_computed_tokens=0),))
        screen.poll_stats()
        await pilot.pause()
        assert "waiting for the engine · 4,096 prompt tokens" in str(reply.query_one(".meta").render())
        engine.frozen_stats = None
        engine.paused = False
        await idle(pilot, screen)
        assert "reading" not in str(reply.query_one(".meta").render())


# --- embedded endpoint --------------------------------------------------------------------------


async def test_endpoint_toggle_serves_the_same_engine(tmp_path: Path) -> None:
    port = free_port()
    app, _ = make_app(tmp_path, config=f"[server]\nport = {port}\n")
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await pilot.press("f9")
        await until(pilot, lambda: screen.endpoint.running and "starting" not in screen.sidebar.endpoint_note)
        screen.poll_stats()
        assert f"http://127.0.0.1:{port}/v1" in str(screen.query_one("#endpoint-status", PanelText).render())
        async with httpx.AsyncClient() as client:
            resp = await client.get(f"http://127.0.0.1:{port}/v1/models")
        assert resp.json()["data"][0]["id"] == "fake-model-q4"
        # The endpoint has its own thread and loop: it answers while the UI's loop is held (here
        # by this request, sent without awaiting; on the UI's loop it could never be served).
        resp = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5.0)
        assert resp.json()["data"][0]["id"] == "fake-model-q4"
        await pilot.press("f9")
        await until(pilot, lambda: not screen.endpoint.running)


async def test_endpoint_degrades_with_a_clear_message_without_app_server(tmp_path: Path, monkeypatch: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "app.server", None)  # import now raises ImportError
    app, _ = make_app(tmp_path, serve=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await until(pilot, lambda: screen.sidebar.endpoint_note.startswith("failed"))
        screen.poll_stats()
        assert "embedded endpoint is unavailable" in str(screen.query_one("#endpoint-status", PanelText).render())
        assert not screen.endpoint.running


async def test_quit_while_generating_commits_partial_and_closes_engine(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path, chat_engine(step_delay=0.005))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        engine.hold_after = 2
        await type_and_send(pilot, "a b c d e f g")
        pane = screen.active_pane()
        await until(pilot, lambda: pane.session.reply is not None and pane.session.reply.metrics.num_tokens >= 2)
        await pilot.press("ctrl+q")
    assert engine.closed
    store = ChatStore.in_dir(tmp_path / "data")
    assert store.messages(pane.session.chat.id)[-1].finish_reason == "abort"


# --- snapshot -----------------------------------------------------------------------------------


def test_main_screen_snapshot(tmp_path: Path, snap_compare: Any) -> None:
    """The main screen with deterministic stats and a restored conversation; timers off."""
    data = tmp_path / "data"
    store = ChatStore.in_dir(data)
    chat = store.create_chat("Paged attention")
    store.add_message(chat.id, "user", "What is a KV block?")
    store.add_message(chat.id, "assistant", "A **block** holds the keys and values of `16` tokens.",
                      finish_reason="stop", num_tokens=14, ttft_s=0.12, tokens_per_s=41.3, model="fake-model")
    store.create_chat("Second tab")
    store.close()
    stats = EngineStats(
        num_running=2, num_waiting=1, waiting_for="kv", num_blocks_total=512, num_blocks_used=96,
        num_blocks_cached_free=40,
        block_size=16, kv_bytes_per_token=18432, prefix_cache_hit_rate=0.25, prefill_tokens_per_s=812.0,
        decode_tokens_per_s=57.4, last_batch_size=2, last_num_tokens=2, last_step_time_s=0.035, num_steps=1234,
        weight_bytes_per_step=369_115_648, last_kv_bytes_read=3_760_128, memory_bandwidth=29.4e9,
        requests=(decoding("chatcmpl-a", prompt=40, output=80, blocks=60, ttft=0.2, itl=0.03, rate=30.1),
                  decoding("chatcmpl-b", prompt=20, output=30, blocks=36, ttft=0.3, itl=0.03, rate=27.3)),
    )
    app, _ = make_app(tmp_path, chat_engine(frozen_stats=stats))

    async def settle(pilot: Any) -> None:
        screen = await chat_screen(pilot)
        history = ThroughputHistory()
        for t, rate in enumerate([0, 10, 30, 45, 52, 57, 55, 58, 57.4]):
            history.observe(float(t), rate)
        screen.sidebar.history = history
        screen.poll_stats(now=8.5)
        screen.query_one(TabbedContent).active = screen.panes()[0].id
        app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=settle)


# --- pure parts: panels, store, config, export --------------------------------------------------


def test_bar_cells_are_proportional_and_show_small_holders() -> None:
    assert bar_cells([50, 25], 100, 20) == [10, 5]
    cells = bar_cells([1, 90], 100, 10)
    assert cells[0] == 1 and sum(cells) <= 10
    assert bar_cells([3, 3, 3], 9, 10) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert bar_cells([5], 0, 10) == [0]


def test_kv_segments_group_by_tab_and_api() -> None:
    reqs = tuple(decoding(rid, prompt=1, output=1, blocks=n) for rid, n in
                 [("t1", 3), ("x", 2), ("t2", 4), ("y", 1)])
    stats = EngineStats(num_blocks_total=20, num_blocks_used=10, requests=reqs)
    owners = {"t1": Owner("a", "A", "red"), "t2": Owner("b", "B", "blue")}
    assert [(s.label, s.blocks, s.requests) for s in kv_segments(stats, owners)] == [("A", 3, 1), ("B", 4, 1), ("API", 3, 2)]
    assert "No KV figures" in str(render_kv(EngineStats(), {}, 30))
    remote = EngineStats(num_blocks_total=1000, num_blocks_used=425, block_size=0)
    assert "KV usage 42.5%" in str(render_kv(remote, {}, 30, "from /metrics"))


def test_the_kv_panel_keeps_a_row_per_tab_so_a_reply_changes_no_row_count() -> None:
    """Each change of a panel's height lays out the whole screen: a reply starting or ending only
    changes its tab's figures."""
    tabs = [Owner("a", "A", "red"), Owner("b", "B", "blue")]
    idle = EngineStats(num_blocks_total=20, num_blocks_used=0, block_size=16, num_blocks_cached_free=3)
    busy = dataclasses.replace(idle, num_blocks_used=3, requests=(decoding("t2", prompt=30, output=5, blocks=3),))
    owners = {"t2": tabs[1]}
    assert [(s.label, s.blocks) for s in kv_segments(busy, owners, tabs)] == [("A", 0), ("B", 3)]
    assert [(s.label, s.blocks) for s in kv_segments(idle, {}, tabs)] == [("A", 0), ("B", 0)]
    lines = [render_kv(stats, o, 40, tabs=tabs).plain.count("\n") for stats, o in ((idle, {}), (busy, owners))]
    assert lines[0] == lines[1]


def test_kv_segments_count_shared_blocks_once() -> None:
    """A fork and its parent both hold the parent's prompt blocks: 10 used, not 6 + 8."""
    parent = dataclasses.replace(decoding("t1", prompt=64, output=8, blocks=6), num_shared_blocks=4)
    fork = dataclasses.replace(decoding("t2", prompt=70, output=1, blocks=8), num_shared_blocks=4)
    stats = EngineStats(num_blocks_total=20, num_blocks_used=10, num_blocks_shared=4, requests=(parent, fork))
    owners = {"t1": Owner("a", "A", "red"), "t2": Owner("b", "B (fork)", "blue")}
    segments = [(s.label, s.blocks) for s in kv_segments(stats, owners)]
    assert segments == [("A", 2), ("B (fork)", 4), ("shared by 2 tabs", 4)]
    assert sum(b for _, b in segments) == stats.num_blocks_used
    assert "shared by 2 tabs" in str(render_kv(stats, owners, 40))


def test_store_migrates_old_files_and_refuses_newer_ones(tmp_path: Path) -> None:
    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path)  # a version-1 file: before reply metadata and the meta table
    db.executescript(
        "CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',"
        " settings TEXT NOT NULL DEFAULT '{}', position INTEGER NOT NULL, created_at REAL NOT NULL);"
        "CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,"
        " role TEXT NOT NULL, content TEXT NOT NULL, created_at REAL NOT NULL);"
        "INSERT INTO chats VALUES (1, 'old', '', '{\"temperature\": 0.3}', 0, 0);"
        "INSERT INTO messages VALUES (1, 1, 'user', 'hello', 0);"
        "PRAGMA user_version = 1;"
    )
    db.close()
    store = ChatStore(path)
    assert store.version == SCHEMA_VERSION == 5
    assert store.chats()[0].settings.temperature == 0.3
    message = store.messages(1)[0]
    assert (message.content, message.finish_reason, message.num_tokens, message.model) == ("hello", None, 0, None)
    reply = store.add_message(1, "assistant", "hi", num_tokens=1, model="smollm2-135m-instruct")
    assert store.messages(1)[-1] == reply and reply.model == "smollm2-135m-instruct"
    store.set_meta("active_chat", "1")
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version 99, newer"):
        ChatStore(path)


def test_config_parses_and_rejects_with_one_line_messages(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('model = "~/m.gguf"\ndevice = "cpu"\n[sampling]\ntop_p = 0.9\nseed = 3\n[server]\nport = 9000\n')
    config = load_config(path, explicit=True)
    assert config.model == str(Path.home() / "m.gguf") and config.device == "cpu" and config.server_port == 9000
    assert config.sampling == ChatSettings(temperature=0.7, top_p=0.9, max_tokens=512, seed=3)
    cases = [
        ('modle = "x"', "unknown key 'modle'"),
        ("[sampling]\ntemperature = -1", "invalid temperature"),
        ('[sampling]\nmax_tokens = "many"', "sampling.max_tokens"),
        ('[keymap]\nfly = "ctrl+f"', "unknown binding id 'fly'"),
        ("model = ", "cannot read config"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            load_config(path, explicit=True)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", explicit=True)
    assert load_config(tmp_path / "missing.toml").model is None


def test_unknown_theme_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown theme 'nope'"):
        make_app(tmp_path, config='theme = "nope"\n')


def test_export_marks_stopped_replies_and_system_prompt(tmp_path: Path) -> None:
    store = ChatStore.in_dir(tmp_path)
    chat = store.create_chat("T", "Be kind.")
    store.add_message(chat.id, "user", "q")
    store.add_message(chat.id, "assistant", "partial", finish_reason="abort")
    text = chat_to_markdown(chat, store.messages(chat.id))
    assert "## System\n\nBe kind.\n" in text and "*(reply ended: abort)*" in text


# --- remote backend -----------------------------------------------------------------------------


def _sse(*events: Any) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _mock_server(requests: list[Any], metrics: str | None = None) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m1", "max_model_len": 2048}, {"id": "m2"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics) if metrics else httpx.Response(404)
        body = json.loads(request.content)
        if body["max_tokens"] == 1:
            return httpx.Response(400, json={"error": {"message": "max_tokens too small", "param": "max_tokens"}})
        if body["max_tokens"] == 2:
            return httpx.Response(429, json={"error": {"message": "queue full"}})
        chunks = [{"choices": [{"delta": {"content": w}, "finish_reason": None}]} for w in ("Hel", "lo", "!")]
        chunks.append({"choices": [{"delta": {}, "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
        return httpx.Response(200, content=_sse(*chunks, "[DONE]"), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


async def test_remote_engine_streams_chat_and_maps_errors() -> None:
    seen: list[httpx.Request] = []
    transport = _mock_server(seen)
    engine = await asyncio.to_thread(RemoteEngine.connect, "http://gpu-box:8000/v1/", api_key="k",
                                     model="m1", transport=transport, async_transport=transport)
    assert (engine.model_name, engine.max_model_len, engine.device) == ("m1", 2048, "remote gpu-box:8000")
    params = SamplingParams(max_tokens=5, temperature=0.0, seed=4, top_k=20)
    deltas = [d async for d in engine.stream([{"role": "user", "content": "hi"}], params, "r1")]
    assert "".join(d.text for d in deltas) == "Hello!"
    assert (deltas[-1].finish_reason, deltas[-1].num_prompt_tokens, deltas[-1].num_output_tokens) == ("length", 9, 3)
    chat_request = next(r for r in seen if r.url.path == "/v1/chat/completions")
    body = json.loads(chat_request.content)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["stream"] is True
    assert (body["seed"], body["top_k"], body["temperature"]) == (4, 20, 0.0) and "min_p" not in body
    assert chat_request.headers["authorization"] == "Bearer k"
    with pytest.raises(RequestError, match="max_tokens too small") as info:
        [d async for d in engine.stream("text prompt", SamplingParams(max_tokens=1))]
    assert info.value.param == "max_tokens"
    with pytest.raises(QueueFullError, match="busy"):
        [d async for d in engine.stream("text prompt", SamplingParams(max_tokens=2))]
    stats = engine.stats()
    assert stats.total_output_tokens == 3 and stats.num_running == 0
    await asyncio.sleep(0.05)  # the /metrics probe answers 404: client-side figures from then on
    assert "client-side" in engine.stats_source
    await engine.aclose()


def test_remote_connect_errors_are_one_line() -> None:
    with pytest.raises(RemoteError, match="must start with http"):
        RemoteEngine.connect("gpu-box:8000/v1")
    refused = httpx.MockTransport(lambda r: httpx.Response(401, json={"error": {"message": "bad key"}}))
    with pytest.raises(RemoteError, match="check --api-key"):
        RemoteEngine.connect("http://h/v1", transport=refused)
    with pytest.raises(RemoteError, match="does not serve 'zz'"):
        RemoteEngine.connect("http://h/v1", model="zz", transport=_mock_server([]))


def test_parse_metrics_reads_localbatch_vllm_and_llamacpp_names() -> None:
    localbatch = """# HELP localbatch:num_requests_running Requests in the running batch.
localbatch:num_requests_running{model_name="m"} 3
localbatch:num_requests_waiting{model_name="m"} 2
localbatch:kv_cache_usage_perc{model_name="m"} 0.25
localbatch:kv_cache_blocks_total{model_name="m"} 400
localbatch:generation_tokens_total{model_name="m"} 1200
"""
    assert parse_metrics(localbatch) == {"running": 3, "waiting": 2, "kv_usage": 0.25, "blocks_total": 400,
                                         "generation_total": 1200}
    vllm = 'vllm:cache_config_info{block_size="16",model="a,b",num_gpu_blocks="800"} 1.0\nvllm:gpu_cache_usage_perc 0.5\n'
    assert parse_metrics(vllm) == {"block_size": 16, "blocks_total": 800, "kv_usage": 0.5}
    assert parse_metrics("llamacpp:requests_deferred 1\nllamacpp:kv_cache_usage_ratio 0.1\n") == {"waiting": 1, "kv_usage": 0.1}
    assert parse_metrics("process_cpu_seconds_total 3\n") == {}


def test_remote_kv_figures_of_a_hybrid_localbatch_server() -> None:
    """A localbatch server says what fits at its running mix and what a token costs past the
    sliding window; the remote panel shows those instead of free blocks x block size."""
    text = """localbatch:kv_cache_usage_perc 0.5
localbatch:kv_cache_blocks_total 600
localbatch:kv_cache_block_size 16
localbatch:kv_bytes_per_token 18432
localbatch:kv_bytes_per_token_past_window 3072
localbatch:kv_cache_tokens_fit 4800
"""
    fields = RemoteEngine._kv_fields(parse_metrics(text))
    assert fields["num_tokens_fit"] == 4800 and fields["kv_bytes_per_token_past_window"] == 3072
    panel = render_kv(EngineStats(**fields), {}, 40).plain
    assert "4,800 more tokens fit" in panel and "3.0 KiB/token past the window" in panel
    assert "num_tokens_fit" not in RemoteEngine._kv_fields(parse_metrics(text.replace("kv_cache_tokens_fit", "x")))


async def test_remote_engine_against_localbatch_server_reads_its_metrics() -> None:
    with ServerThread(FakeEngine(model_name="served", step_delay=0.002)) as server:
        engine = await asyncio.to_thread(RemoteEngine.connect, server.url + "/v1")
        engine._metrics_interval = 0.05
        assert engine.model_name == "served"
        deltas = [d async for d in engine.stream([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=8, temperature=0))]
        assert deltas[-1].finish_reason in ("stop", "length") and deltas[-1].num_output_tokens >= 1
        deadline = time.monotonic() + 5
        while engine._metrics.available is None and time.monotonic() < deadline:
            engine.stats()
            await asyncio.sleep(0.02)
        stats = engine.stats()
        assert engine._metrics.available and "metrics" in engine.stats_source
        assert stats.num_blocks_total > 0  # its KV usage, from localbatch:kv_cache_usage_perc
        await engine.aclose()


async def test_app_on_a_remote_backend_chats_and_shows_remote_figures(tmp_path: Path) -> None:
    with ServerThread(FakeEngine(model_name="served", max_model_len=2048, step_delay=0.002)) as server:
        app, _ = make_app(tmp_path, backend_url=server.url + "/v1")
        async with app.run_test(size=SIZE) as pilot:
            screen = await chat_screen(pilot)
            assert screen.info.model_name == "served" and screen.endpoint is None
            await type_and_send(pilot, "hello there")
            await idle(pilot, screen)
            reply = screen.active_pane().session.messages[-1]
            assert reply.role == "assistant" and reply.content and reply.finish_reason in ("stop", "length")
            screen.poll_stats()
            assert "remote backend" in str(screen.query_one("#endpoint-status", PanelText).render())
            await pilot.press("ctrl+q")
        assert app.engine is None  # closed on quit


async def test_reply_keeps_single_line_breaks() -> None:
    """A model's line-by-line reply (a poem) keeps its lines: a single newline is a break."""
    from textual.app import App

    from app.ui.widgets import MessageView

    class One(App):
        def compose(self):
            yield MessageView("assistant", "Roses are red,\nviolets are blue.")

    app = One()
    async with app.run_test(size=(60, 10)) as pilot:
        await pilot.pause()
        rendered = [str(w.render()) for w in app.query_one(Markdown).query("*")]
        assert any("red,\nviolets" in text for text in rendered), rendered


def test_throughput_panel_explains_batching() -> None:
    """The bytes read per generated token fall as sequences join a step; no figures, no lines."""
    from app.ui.panels import render_traffic

    def stats(batch: int, step_s: float) -> EngineStats:
        return EngineStats(num_steps=9, last_batch_size=batch, last_num_tokens=batch, last_step_time_s=step_s,
                           weight_bytes_per_step=360 * 2**20, last_kv_bytes_read=batch * 2**20, memory_bandwidth=30e9)

    one, four = render_traffic(stats(1, 0.040)), render_traffic(stats(4, 0.064))
    assert "read/step 360.0 MiB + KV 1.0 MiB" in one
    assert "361.0 MiB/token" in one and "91.0 MiB/token" in four
    assert "9.5 of 30 GB/s" in one
    assert render_traffic(EngineStats()) == ""
    # Before the first step: the same lines, with dashes (a line appearing is a layout).
    before = render_traffic(EngineStats(weight_bytes_per_step=360 * 2**20, memory_bandwidth=30e9))
    assert before.count("\n") == one.count("\n") and "–/token · – of 30 GB/s" in before


async def test_what_is_typed_while_the_model_loads_is_kept(tmp_path: Path) -> None:
    """Enter while loading sends the message once the model is ready; what is typed after it
    waits in the chat's input. Nothing typed is lost."""
    release = threading.Event()
    engine = FakeEngine()

    def factory(progress: Any, model: Any, device: Any, config: Any) -> Any:
        progress("loading tensors", 0.5)
        release.wait(10)
        return engine

    app = LocalbatchApp(factory, TuiOptions(data_dir=tmp_path, config_path=_empty_config(tmp_path), tools=False))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LoadingScreen))
        loading = app.screen
        await pilot.press(*"hello", "enter", *"draft")
        await until(pilot, lambda: loading.queued == "hello")
        assert "Sent when the model is ready" in str(loading.query_one("#loading-queued", Static).render())
        release.set()
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await until(pilot, lambda: [m.content for m in pane.session.messages][:1] == ["hello"])
        assert pane.prompt.text == "draft"


def test_the_rate_history_takes_a_poll_that_comes_a_little_early() -> None:
    """Panels poll once a second on the frame clock; a poll 20 ms early still records its sample."""
    history = ThroughputHistory(seconds=5)
    assert [history.observe(t, 10.0) for t in (0.0, 0.98, 1.97, 2.3)] == [True, True, True, False]
