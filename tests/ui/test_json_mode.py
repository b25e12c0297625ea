"""A tab's JSON mode: the palette toggle and the settings form (switch + optional schema) turn into
the request's `json_object` / `json_schema`; a schema that is not JSON is refused in the form."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Switch, TextArea

from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


async def test_palette_toggle_sends_json_object_and_survives_restart(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        screen.action_command("toggle_json")
        await pilot.pause()
        pane = screen.active_pane()
        assert "JSON" in str(pane.query_one(".settings-title").render())
        await type_and_send(pilot, "a city as JSON")
        await idle(pilot, screen)
        params = engine.submitted[-1].params
        assert params.json_object is True and params.json_schema is None
        chat_id = pane.session.chat.id
    app2, _ = make_app(tmp_path)
    async with app2.run_test(size=SIZE) as pilot:
        await chat_screen(pilot)
        assert app2.store.chat(chat_id).settings.json_mode is True


async def test_settings_form_schema_is_sent_and_bad_json_is_refused(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        pane = screen.active_pane()
        await pilot.press("f3")
        form = pane.query_one(".settings-form")
        form.query_one(".json-mode", Switch).value = True
        form.query_one(".json-schema", TextArea).text = "{not json"
        await pilot.pause()
        assert "json_schema" in str(form.query_one(".settings-error").render()) or "not valid JSON" in str(
            form.query_one(".settings-error").render())
        assert app.store.chat(pane.session.chat.id).settings.json_schema == ""
        form.query_one(".json-schema", TextArea).text = json.dumps(SCHEMA)
        await pilot.pause()
        assert str(form.query_one(".settings-error").render()) == ""
        await pilot.press("f3")
        await type_and_send(pilot, "a city")
        await idle(pilot, screen)
        params = engine.submitted[-1].params
        assert params.json_schema == SCHEMA and not params.json_object
