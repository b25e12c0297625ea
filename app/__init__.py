"""localbatch: a local LLM app on an in-process continuous-batching engine."""

from importlib.resources import files
from pathlib import Path

__version__ = "0.1.0"


def _assets_dir() -> Path:
    """The shipped data (chat templates, Textual CSS).

    The repository keeps it in the top-level `assets/`; pyproject maps that directory to the package
    `app.assets`, so an installed wheel has it at `app/assets/`. A source checkout or an editable
    install (whose `app` is the repository's `app/`) reads the top-level directory itself."""
    installed = Path(str(files(__name__) / "assets"))
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "assets"


#: Directory of the shipped data; `app/assets` in a wheel, `<repo>/assets` in a checkout.
ASSETS_DIR = _assets_dir()
