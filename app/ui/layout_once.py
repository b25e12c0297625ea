"""Widgets laid out once per change of size.

Textual's layout pass gives every resized widget its new `virtual_size`, a reactive that asks for
a second layout of the whole screen. For the chat's widgets that pass moves nothing (their sizes
came from the first one; scrollbars and the anchored scroll are updated by the first one too),
but it costs as much as the first, and on two cores the UI thread's time comes out of the
engine's: a reply growing, starting or ending laid the screen out twice."""

from __future__ import annotations

from textual.geometry import Size


class LaidOutOnce:
    """Mixin (before the widget class): take a new size without asking for another layout."""

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        return super()._size_updated(size, virtual_size, container_size, layout=False)  # type: ignore[misc]
