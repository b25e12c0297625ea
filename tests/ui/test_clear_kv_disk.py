"""The palette's "Clear the KV disk cache": the app asks its engine (in-process or `--backend-url`)
and says in one line what went; a remote server without the route says so."""

from __future__ import annotations

from pathlib import Path

import httpx

from app.clients.remote import RemoteEngine
from tests.support.fake_engine import FakeEngine, ServerThread
from tests.ui.test_tui import SIZE, chat_screen, make_app


def notes(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def test_the_palette_action_clears_through_the_engine(tmp_path: Path) -> None:
    app, engine = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await screen.action_command("clear_kv_disk_cache")
        await pilot.pause()
        assert engine.kv_disk_clears == 1
        assert any(n.startswith("Cleared the KV disk cache") for n in notes(app))


async def test_a_localbatch_server_clears_its_cache_for_a_remote_app(tmp_path: Path) -> None:
    fake = FakeEngine(model_name="served")
    with ServerThread(fake) as server:
        app, _ = make_app(tmp_path, backend_url=server.url + "/v1")
        async with app.run_test(size=SIZE) as pilot:
            screen = await chat_screen(pilot)
            await screen.action_command("clear_kv_disk_cache")
            await pilot.pause()
            assert fake.kv_disk_clears == 1
            assert any(n.startswith("Cleared the KV disk cache") for n in notes(app))


async def test_a_server_without_the_route_is_said_in_one_line() -> None:
    remote = RemoteEngine("http://other:8080/v1", "m", transport=httpx.MockTransport(lambda r: httpx.Response(404)))
    try:
        message = await remote.clear_kv_disk_cache()
    finally:
        await remote.aclose()
    assert message == "The server at http://other:8080 has no KV disk cache to clear (only localbatch serve has)"
