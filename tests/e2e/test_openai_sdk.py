"""Opt-in end-to-end check (LOCALBATCH_E2E=1): `localbatch serve` on a pulled chat model through the
official OpenAI SDK (tests/e2e/openai_sdk_check.py). What the grammar guarantees must hold on any
model: schema-valid JSON, the SDK's `parse`, forced tool calls, streamed pieces that join, 400s
with OpenAI's error object. Whether a model calls a tool under tool_choice "auto" when it should
is the model's judgement: printed, not asserted. Minutes on a 2-core CPU, hence opt-in."""

from __future__ import annotations

import os

import pytest

MODEL = os.environ.get("LOCALBATCH_E2E_MODEL", "qwen2.5-coder-1.5b-instruct")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("LOCALBATCH_E2E") != "1", reason="opt-in: set LOCALBATCH_E2E=1")]


def test_structured_output_and_tool_calls_through_the_sdk() -> None:
    pytest.importorskip("openai")
    pytest.importorskip("jsonschema")
    from app.engine.gguf.catalog import installed_path

    if installed_path(MODEL) is None:
        pytest.skip(f"{MODEL} is not pulled: run `localbatch pull {MODEL}` (or set LOCALBATCH_E2E_MODEL)")
    from tests.e2e.openai_sdk_check import local_server, run

    with local_server(MODEL, []) as url:
        checks = run(url, count=8)
    failed = [c.line() for c in checks if c.passed != c.total and not c.name.startswith("tool_choice auto")]
    assert not failed, "\n".join(failed)
