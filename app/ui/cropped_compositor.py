"""A compositor whose partial updates render only the area they repaint.

Textual's partial update renders every widget whose container's visible area meets the bounding
box of the dirty regions, each one whole: a reply's changed line rendered the header, the footer,
the sidebar, the prompt and every container of the chat, all of their lines (3 ms of the UI thread
a frame, five frames a second, on two cores shared with the engine). Here a widget outside that
box renders nothing and one inside it only the box's rows: the same output in the repainted
spans, from the few widgets under them. A full render (no box) is Textual's own."""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import Compositor
from textual.geometry import Region
from textual.strip import Strip


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
