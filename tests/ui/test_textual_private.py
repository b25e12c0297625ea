"""The UI's patches on Textual's private API (app/ui/textual_private.py): the installed Textual has
every name each one relies on, in the tested shape, else the test names the patch and the name;
and where a name changed, the app starts and chats on plain Textual instead of crashing."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual._compositor import Compositor
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Markdown, TabbedContent, Tabs, TextArea

from app.ui import layout_once, textual_private
from app.ui.cropped_compositor import CroppedCompositor
from app.ui.layout_once import LaidOutOnce
from app.ui.textual_private import (
    CROPPED_COMPOSITOR,
    LAYOUT_ONCE,
    PATCHES,
    QUIET_RELABEL,
    TESTED,
    problems,
    supported,
)
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send

ROOT = Path(__file__).resolve().parents[2]
NEEDS = [(patch.name, need) for patch in PATCHES.values() for need in patch.needs]


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Iterator[None]:
    """Each test checks the Textual it sees (some change its names), and leaves no verdict behind."""
    textual_private.forget()
    yield
    textual_private.forget()


@pytest.mark.parametrize(("patch", "need"), NEEDS, ids=[f"{p}:{n.path}" for p, n in NEEDS])
def test_textual_has_what_each_patch_needs(patch: str, need: textual_private.Need) -> None:
    problem = textual_private._problem(patch, need)
    assert problem is None, problem


def test_every_patch_is_installed_on_the_tested_textual() -> None:
    assert {name: problems(name) for name in PATCHES} == {name: [] for name in PATCHES}
    assert all(supported(name) for name in PATCHES)


def test_the_installed_textual_is_the_pinned_range_and_the_pin_is_the_tested_one() -> None:
    version = importlib.metadata.version("textual")
    assert version.split(".")[0] == "8", (
        f"textual {version} is outside {TESTED}: check the patches in app/ui/textual_private.py")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert TESTED in dependencies, f"pyproject.toml pins textual otherwise than textual_private.TESTED ({TESTED})"


def test_the_prompts_key_hook_is_there() -> None:
    """PromptInput overrides TextArea._on_key, the hook Textual's TextArea guide tells subclasses
    to override, and calls it for the keys it leaves to the editor."""
    changed = "widgets.PromptInput: textual.widgets.TextArea._on_key {}; Textual changed its API"
    assert hasattr(TextArea, "_on_key"), changed.format("is gone")
    params = tuple(inspect.signature(TextArea._on_key).parameters)
    assert params == ("self", "event"), changed.format(f"takes {params}")


def test_a_name_gone_is_reported_with_the_patch_and_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Tabs, "_highlight_active")
    assert problems(QUIET_RELABEL) == [
        f"quiet_relabel: textual.widgets.Tabs._highlight_active is gone; Textual changed its private API "
        f"(tested: {TESTED}), so the app runs plain Textual there"
    ]


def test_a_name_of_another_shape_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Compositor, "_get_renders", lambda self, region=None: [])
    monkeypatch.setattr(Compositor, "_render_chops", lambda self, crop, is_rendered_line: [])
    assert problems(CROPPED_COMPOSITOR) == [
        f"cropped_compositor: textual._compositor.Compositor._get_renders takes (self, region), not (self, crop); "
        f"Textual changed its private API (tested: {TESTED}), so the app runs plain Textual there",
        f"cropped_compositor: textual._compositor.Compositor._render_chops no longer uses _get_renders; "
        f"Textual changed its private API (tested: {TESTED}), so the app runs plain Textual there",
    ]


def change_textuals_private_names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """A Textual whose private names each patch uses take another parameter: they still work for
    Textual (which calls them as before) but no longer match what the patches were written for."""
    calls: dict[str, list[Any]] = {"layout": []}
    get_renders, size_updated, highlight = Compositor._get_renders, Widget._size_updated, Tabs._highlight_active

    def renders(self: Any, crop: Any = None, changed: bool = False) -> Any:
        return get_renders(self, crop)

    def resized(self: Any, size: Size, virtual_size: Size, container_size: Size, layout: bool = True,
                changed: bool = False) -> bool:
        calls["layout"].append(layout)
        return size_updated(self, size, virtual_size, container_size, layout)

    def underline(self: Any, animate: bool = True, changed: bool = False) -> None:
        highlight(self, animate)

    monkeypatch.setattr(Compositor, "_get_renders", renders)
    monkeypatch.setattr(Widget, "_size_updated", resized)
    monkeypatch.setattr(Tabs, "_highlight_active", underline)
    return calls


async def test_a_changed_textual_runs_the_app_plain_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=textual_private.__name__)
    calls = change_textuals_private_names(monkeypatch)
    monkeypatch.setattr(LaidOutOnce, "_size_updated", LaidOutOnce._size_updated)  # put back after
    layout_once.install()  # as the import does on such a Textual
    assert "_size_updated" not in vars(LaidOutOnce)
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert type(screen._compositor) is Compositor  # Textual's own
        await type_and_send(pilot, "hello there")  # a first message titles the tab: a relabel
        await idle(pilot, screen)
        pane = screen.active_pane()
        assert pane is not None and pane.query(Markdown).last().source == "Reply to: hello there"
        tab = screen.query_one(TabbedContent).get_tab(pane.id or "")
        assert pane.session.chat.title == "hello there" and "hello there" in tab.label.plain
    assert not any(supported(name) for name in PATCHES)
    assert True in calls["layout"]  # the chat's widgets asked for Textual's second layout
    warned = [r.getMessage() for r in caplog.records if r.name == textual_private.__name__]
    assert sorted(warned) == sorted(p for name in PATCHES for p in problems(name))  # once each
    assert {w.split(":")[0] for w in warned} == set(PATCHES)


class Probe(LaidOutOnce, Widget):
    pass


def test_laid_out_once_asks_for_no_layout_only_on_the_tested_textual(monkeypatch: pytest.MonkeyPatch) -> None:
    size = Size(10, 2)
    assert supported(LAYOUT_ONCE) and "_size_updated" in vars(LaidOutOnce)  # installed at import
    sent: list[bool] = []
    monkeypatch.setattr(Widget, "_size_updated", lambda self, size, virtual_size, container_size, layout=True:
                        sent.append(layout) or False)
    Probe()._size_updated(size, size, size)
    monkeypatch.setattr(LaidOutOnce, "_size_updated", LaidOutOnce._size_updated)  # put back after
    monkeypatch.setattr(Widget, "_size_updated", lambda self, size, virtual_size, container_size, layout=True,
                        changed=False: sent.append(layout) or False)
    textual_private.forget()
    layout_once.install()
    Probe()._size_updated(size, size, size)
    assert sent == [False, True]


def test_cropped_compositor_is_a_compositor() -> None:
    assert issubclass(CroppedCompositor, Compositor)
