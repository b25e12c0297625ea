"""The embedded endpoint's thread: it starts, stops and fails with a message, with no engine or
server behind it (a fake `serve`)."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest

from app.ui.endpoint import EmbeddedEndpoint, EndpointError


def endpoint(serve: Any) -> EmbeddedEndpoint:
    return EmbeddedEndpoint(engine=None, host="127.0.0.1", port=8123, serve_fn=serve)  # type: ignore[arg-type]


async def test_serves_on_its_own_thread_until_stopped() -> None:
    seen: dict[str, Any] = {}

    async def serve(engine: Any, host: str, port: int, api_key: str | None, ready: asyncio.Event) -> None:
        seen["thread"] = threading.current_thread().name
        ready.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    ep = endpoint(serve)
    assert await ep.start() == "http://127.0.0.1:8123/v1"
    assert ep.running and seen["thread"] == "localbatch-endpoint"
    await ep.stop()
    assert not ep.running and seen["cancelled"] and ep.error is None


@pytest.mark.parametrize(("failure", "message"), [
    (OSError(98, "Address already in use"), "cannot listen on 127.0.0.1:8123: Address already in use"),
    (SystemExit(1), "port in use?"),
    (RuntimeError("boom"), "stopped unexpectedly (RuntimeError: boom)"),
])
async def test_a_failure_at_start_up_is_one_clear_error(failure: BaseException, message: str) -> None:
    async def serve(*args: Any, **kwargs: Any) -> None:
        raise failure

    ep = endpoint(serve)
    with pytest.raises(EndpointError, match=re.escape(message)):
        await ep.start()
    assert not ep.running


async def test_a_start_that_hangs_times_out_and_leaves_no_thread() -> None:
    async def serve(*args: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()  # never ready

    ep = endpoint(serve)
    with pytest.raises(EndpointError, match="did not start within 0 s"):
        await ep.start(timeout=0.2)
    assert not ep.running
