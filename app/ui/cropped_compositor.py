"""A compositor whose partial updates render only the area they repaint.

Textual's partial update renders every widget whose container's visible area meets the bounding
box of the dirty regions, each one whole: a reply's changed line rendered the header, the footer,
the sidebar, the prompt and every container of the chat, all of their lines, at every frame and
on cores shared with the engine (docs/tuning.md). Here a widget outside that box renders nothing
and one inside it only the box's rows: the same output in the repainted spans, from the few
widgets under them. A full render (no box) is Textual's own.

It overrides Textual's private `Compositor._get_renders` and replaces a screen's private
`_compositor`: `install` does so only where textual_private finds them as tested."""

from __future__ import annotations

from collections.abc import Iterable

from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip

from app.ui.textual_private import CROPPED_COMPOSITOR, supported

try:
    from textual._compositor import Compositor
except ImportError:  # Textual moved it: the class below is never installed (supported() is False)
    Compositor = object  # type: ignore[misc,assignment]


class CroppedCompositor(Compositor):
    def _get_renders(self, crop: Region | None = None) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if not crop:
            yield from super()._get_renders(crop)
            return
        for widget, (region, clip) in self.visible_widgets.items():  # front to back, as Textual's
            if not crop.overlaps(region.intersection(clip)):
                continue
            # Only rows are cropped: a line's pieces must start and end where Textual cuts it.
            clip = clip.intersection(Region(clip.x, crop.y, clip.width, crop.height))
            x, y, width, height = region.intersection(clip)
            if width and height:
                yield region, clip, widget.render_lines(Region(x - region.x, y - region.y, width, height))


def install(screen: Screen) -> None:
    """Give `screen` a CroppedCompositor, or leave Textual's where its private API changed."""
    if supported(CROPPED_COMPOSITOR) and type(getattr(screen, "_compositor", None)) is Compositor:
        screen._compositor = CroppedCompositor()
