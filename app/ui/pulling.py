"""Pulling a catalog model from the app while the current model keeps serving: the download runs
in a thread; the screen reads its latest progress on its own frame clock (no call across threads
per progress report) and the app says once when it is done or why it failed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PullState:
    """The latest progress of one pull, written by its thread and read by the UI's frame clock."""

    name: str
    stage: str = "starting"
    fraction: float | None = None
    done: bool = False
    error: str | None = None

    def report(self, stage: str, fraction: float | None) -> None:
        self.stage, self.fraction = stage, fraction

    def line(self) -> str:
        """Side-panel lines: the model, a bar where the fraction is known, the stage's detail."""
        detail = self.stage.replace(f" {self.name}:", ":")
        if self.fraction is None:
            return f"pulling {self.name}\n{detail}"
        filled = int(self.fraction * 20)
        return f"pulling {self.name}\n{'█' * filled}{'░' * (20 - filled)} {self.fraction * 100:3.0f}%\n{detail}"


def start_pull(name: str, pull: Callable[..., object], finished: Callable[[PullState], None]) -> PullState:
    """Run `pull(name, progress=...)` in a daemon thread; `finished(state)` is called from that
    thread when it ends (the caller hands it to the UI thread)."""
    state = PullState(name)

    def run() -> None:
        try:
            pull(name, progress=state.report)
        except Exception as e:  # a LocalbatchError names the part; anything else still gets a line
            state.error = str(e) or type(e).__name__
        state.done = True
        finished(state)

    threading.Thread(target=run, name=f"pull-{name}", daemon=True).start()
    return state
