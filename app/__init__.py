"""localbatch: a local LLM app on an in-process continuous-batching engine."""

from pathlib import Path

__version__ = "0.1.0"

#: Shipped data (chat templates, Textual CSS). Lives at the repository root, next to the package.
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
