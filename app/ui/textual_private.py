"""The UI's patches on Textual's private API, each with what it needs and a check of it.

Textual's private names change without notice between releases. Each patch here is installed only
where the installed Textual still has the names it relies on, in the shape it was written for; on
another, it logs one warning and the app runs plain Textual (slower, never broken).
tests/ui/test_textual_private.py fails, naming the patch, when a Textual in the tested range
differs. See docs/textual.md."""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

# The names below read the same in Textual's source from 1.0.0 to 8.2.8; the app is tested on 8.x.
TESTED = "textual>=8.0,<9"

CROPPED_COMPOSITOR = "cropped_compositor"
LAYOUT_ONCE = "layout_once"
QUIET_RELABEL = "quiet_relabel"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Need:
    """One private name a patch relies on."""

    path: str  # dotted: module, then attributes
    params: tuple[str, ...] | None = None  # a callable's parameter names, in order
    names: tuple[str, ...] = ()  # names a function's own code uses (what it calls or sets)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    needs: tuple[Need, ...]


PATCHES: dict[str, Patch] = {
    patch.name: patch
    for patch in (
        Patch(
            CROPPED_COMPOSITOR,
            "a partial update renders only the rows it repaints (app/ui/cropped_compositor.py)",
            (
                Need("textual._compositor.Compositor._get_renders", params=("self", "crop")),
                Need("textual._compositor.Compositor._render_chops", names=("_get_renders",)),
                Need("textual._compositor.Compositor.visible_widgets"),
                Need("textual.screen.Screen.__init__", names=("_compositor", "Compositor")),
            ),
        ),
        Patch(
            LAYOUT_ONCE,
            "a resized chat widget asks for no second layout (app/ui/layout_once.py)",
            (
                Need(
                    "textual.widget.Widget._size_updated",
                    params=("self", "size", "virtual_size", "container_size", "layout"),
                ),
            ),
        ),
        Patch(
            QUIET_RELABEL,
            "a relabelled tab moves the underline without a 0.3 s slide (app/ui/screen.py relabel)",
            (Need("textual.widgets.Tabs._highlight_active", params=("self", "animate")),),
        ),
    )
}

_verdicts: dict[str, bool] = {}


def _resolve(path: str) -> Any:
    """The object at a dotted path; raises LookupError where any part of it is gone."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            try:
                found = getattr(found, attribute)  # not getattr_static: textual.widgets loads lazily
            except AttributeError:
                raise LookupError(path) from None
        return found
    raise LookupError(path)


def _code(found: Any) -> Any:
    function = found.fget if isinstance(found, property) else found
    return getattr(inspect.unwrap(function), "__code__", None)


def _problem(patch: str, need: Need) -> str | None:
    changed = (f"{patch}: {need.path} {{}}; Textual changed its private API (tested: {TESTED}), "
               "so the app runs plain Textual there")
    try:
        found = _resolve(need.path)
    except LookupError:
        return changed.format("is gone")
    if need.params is not None:
        try:
            params = tuple(inspect.signature(found).parameters)
        except (TypeError, ValueError):
            return changed.format("is no longer a function")
        if params != need.params:
            return changed.format(f"takes ({', '.join(params)}), not ({', '.join(need.params)})")
    if need.names:
        code = _code(found)
        missing = [name for name in need.names if code is None or name not in code.co_names]
        if missing:
            return changed.format(f"no longer uses {', '.join(missing)}")
    return None


def problems(name: str) -> list[str]:
    """What the installed Textual lacks of what patch `name` needs; empty where it has it all."""
    found = (_problem(name, need) for need in PATCHES[name].needs)
    return [problem for problem in found if problem]


def supported(name: str) -> bool:
    """Whether patch `name` may be installed; checked once, and a refusal logged once."""
    verdict = _verdicts.get(name)
    if verdict is None:
        found = problems(name)
        for problem in found:
            _log.warning(problem)
        verdict = _verdicts[name] = not found
    return verdict


def forget() -> None:
    """Check again at the next `supported` (tests that change Textual's names)."""
    _verdicts.clear()
