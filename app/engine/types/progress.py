"""The loading-progress callback, shared by the loader, the engines and the TUI. Torch-free, so the
TUI can name it without importing the engine."""

from __future__ import annotations

from collections.abc import Callable

# progress(stage, fraction): `stage` names the step under way in words ("loading tensors"); a new
# stage means the one before is done. `fraction` is how far that stage has got, in [0, 1], or None
# when it cannot tell. The loader calls it from its own thread, so it must be quick and thread-safe.
ProgressFn = Callable[[str, "float | None"], None]
