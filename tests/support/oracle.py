"""llama.cpp's reference data: `shared/oracle` beside the repository, or LOCALBATCH_ORACLE_DIR; a
test that reads it is skipped, with the reason, where it is not there (a clone elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ORACLE_DIR = Path(os.environ.get("LOCALBATCH_ORACLE_DIR", Path(__file__).resolve().parents[3] / "shared" / "oracle"))

needs_oracle = pytest.mark.skipif(not ORACLE_DIR.is_dir(),
                                  reason=f"oracle data not found in {ORACLE_DIR} (set LOCALBATCH_ORACLE_DIR)")
