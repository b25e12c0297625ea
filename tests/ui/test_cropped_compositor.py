"""The chat screen's compositor renders only the area a partial update repaints, and what it
paints there is what Textual's own compositor paints."""

from __future__ import annotations

from pathlib import Path
from types import MethodType
from typing import Any

from textual._compositor import Compositor
from textual.geometry import Region

from app.ui.cropped_compositor import CroppedCompositor
from tests.support.fake_engine import FakeEngine
from tests.ui.test_tui import SIZE, chat_screen, idle, make_app, type_and_send


def _painted(chops: Any, spans: list[tuple[int, int, int]], cuts: list[list[int]]) -> list[tuple]:
    """The segments each span of the update shows (what reaches the terminal)."""
    out = []
    for y, x1, x2 in spans:
        line = chops[y]
        out.append((y, x1, x2, [(cut, list(line[cut])) for cut in cuts[y][:-1] if x1 <= cut < x2]))
    return out


async def test_partial_updates_paint_what_textuals_compositor_paints(tmp_path: Path, monkeypatch: Any) -> None:
    engine = FakeEngine(model_name="fake-model-q4", max_model_len=4096, step_delay=0.003)
    app, _ = make_app(tmp_path, engine, poll_interval=0.5)
    frames: list[tuple[int, int, int]] = []  # (rows repainted, widgets' lines rendered, Textual's) per partial update
    cropped_renders = CroppedCompositor._render_chops

    def both(self: CroppedCompositor, crop: Region, is_rendered_line: Any) -> Any:
        ours = cropped_renders(self, crop, is_rendered_line)
        if crop == self.size.region:
            return ours
        # The whole box, on the lines being repainted: stricter than the dirty regions alone.
        spans = [(y, x1, x2) for y, x1, x2 in self._regions_to_spans([crop]) if is_rendered_line(y)]
        self._get_renders = MethodType(Compositor._get_renders, self)  # Textual's, on the same map
        try:
            textuals = cropped_renders(self, crop, is_rendered_line)
            stock_lines = sum(len(strips) for _, _, strips in Compositor._get_renders(self, crop))
        finally:
            del self._get_renders
        assert _painted(ours, spans, self.cuts) == _painted(textuals, spans, self.cuts)
        our_lines = sum(len(strips) for _, _, strips in CroppedCompositor._get_renders(self, crop))
        frames.append((crop.height, our_lines, stock_lines))
        return ours

    monkeypatch.setattr(CroppedCompositor, "_render_chops", both)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert isinstance(screen._compositor, CroppedCompositor)
        await type_and_send(pilot, "write a long story")
        await pilot.pause(0.3)
        await idle(pilot, screen)
    # A reply's frames (a few rows; the panels repaint twice a second) leave out the header, the
    # footer, the sidebar and the prompt, and the containers around the reply render its rows only.
    reply_frames = [(ours, textuals) for rows, ours, textuals in frames if rows <= 5]
    assert len(reply_frames) >= 3 and all(ours <= textuals for _, ours, textuals in frames)
    assert sum(ours for ours, _ in reply_frames) < 0.25 * sum(textuals for _, textuals in reply_frames)
