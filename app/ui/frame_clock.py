"""The chat screen's one clock for what repaints while replies stream: the shown tab's reply every
frame (`FRAME_HZ` a second), the panels every `poll_interval` (rounded to frames) while anything
runs and once a second when idle, in the same frame as the reply: one screen refresh, not two."""

from __future__ import annotations

from collections.abc import Callable

from app.ui.chat import ChatPane
from app.ui.reply_stream import FRAME_HZ


class FrameClock:
    """`tick` is the screen's interval callback, `FRAME_HZ` times a second."""

    def __init__(self, shown: Callable[[], ChatPane | None], poll: Callable[[], None], busy: Callable[[], bool],
                 poll_interval: float) -> None:
        self._shown, self._poll, self._busy = shown, poll, busy
        self._frames_per_poll = max(round(poll_interval * FRAME_HZ), 1) if poll_interval > 0 else 0
        self._frame = 0

    async def tick(self) -> None:
        self._frame += 1
        pane = self._shown()
        if pane is not None:
            await pane.paint_reply()
        if self._frames_per_poll and self._frame % self.poll_every() == 0:
            self._poll()

    def poll_every(self) -> int:
        """Frames between panel refreshes: the configured period while anything runs; idle, only
        the recent rates decay (and an API request may arrive), so once a second is enough."""
        if self._busy():
            return self._frames_per_poll
        return max(self._frames_per_poll, FRAME_HZ)
