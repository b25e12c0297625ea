"""`json.dumps(obj, ensure_ascii=False, separators=(",", ":"))` for the per-token SSE chunks, with
the C encoder built once: `json.dumps` builds an encoder object and a C encoder on every call,
most of what a chunk's small dict cost (per token, per stream, on the event loop)."""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring
from typing import Any


def _unsupported(obj: object) -> Any:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


# No cycle check (markers None): chunks are dicts the server builds, never self-referencing.
_ENCODER = (c_make_encoder(None, _unsupported, encode_basestring, None, ":", ",", False, False, True)
            if c_make_encoder is not None else None)


def dumps(obj: Any) -> str:
    """Compact JSON text of `obj`, non-ASCII kept as is (the same text `json.dumps` gives)."""
    if _ENCODER is None:  # an interpreter without json's C accelerator
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return "".join(_ENCODER(obj, 0))
