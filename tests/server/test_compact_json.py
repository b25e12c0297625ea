"""The SSE chunks' encoder gives exactly `json.dumps`'s compact, non-ASCII-keeping text."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.server import compact_json

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20)


def reference(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@given(VALUES)
def test_same_text_as_json_dumps(obj: object) -> None:
    assert compact_json.dumps(obj) == reference(obj)


def test_chunk_shapes() -> None:
    entry = {"index": 0, "delta": {"content": "é \"q\"\n\u2028"}, "logprobs": None, "finish_reason": None}
    assert compact_json.dumps(entry) == reference(entry)
    special = {"top": [-math.inf, math.nan, 1e-300], 3: True, "t": ("a", 1)}
    assert compact_json.dumps(special) == reference(special)


def test_unsupported_values_raise_type_error() -> None:
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        compact_json.dumps({"x": {1, 2}})
