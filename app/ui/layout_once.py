"""Widgets laid out once per change of size.

Textual's layout pass gives every resized widget its new `virtual_size`, a reactive that asks for
a second layout of the whole screen. For the chat's widgets that pass moves nothing (their sizes
came from the first one; scrollbars and the anchored scroll are updated by the first one too),
but it costs as much as the first, and on two cores the UI thread's time comes out of the
engine's: a reply growing, starting or ending laid the screen out twice.

`_size_updated` is Textual's private API: `install` (run at import) puts the override on the mixin
only where textual_private finds it as tested; elsewhere the mixin adds nothing (plain Textual)."""

from __future__ import annotations

from textual.geometry import Size

from app.ui.textual_private import LAYOUT_ONCE, supported


class LaidOutOnce:
    """Mixin (before the widget class): take a new size without asking for another layout."""


def _size_updated(self: LaidOutOnce, size: Size, virtual_size: Size, container_size: Size,
                  layout: bool = True) -> bool:
    return super(LaidOutOnce, self)._size_updated(  # type: ignore[misc]
        size, virtual_size, container_size, layout=False)


def install() -> None:
    """Give LaidOutOnce its override, or take it away where Textual changed `_size_updated`."""
    if supported(LAYOUT_ONCE):
        LaidOutOnce._size_updated = _size_updated  # type: ignore[attr-defined]
    elif "_size_updated" in vars(LaidOutOnce):
        del LaidOutOnce._size_updated  # type: ignore[attr-defined]


install()  # once, at import: a check per call would cost every widget in every layout
