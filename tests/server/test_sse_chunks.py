"""A streamed chunk's bytes: the per-request fields encoded once must give exactly the event that
encoding the whole chunk object gives."""

from __future__ import annotations

import pytest

from app.server.serving import ResponseMeta, _chunk_writer, sse


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_writer_matches_the_whole_object_encoded(include_usage: bool) -> None:
    meta = ResponseMeta.new("chatcmpl", 'modèle "x"', include_usage)
    entry = {"index": 1, "delta": {"content": 'é"\n\\'}, "logprobs": None, "finish_reason": None}
    whole = {**meta.header("chat.completion.chunk"), "choices": [entry]}
    if include_usage:
        whole["usage"] = None
    assert _chunk_writer(meta, "chat.completion.chunk")(entry) == sse(whole)
