"""The embedded OpenAI-compatible endpoint: `app.server.serve` run as a task in the app's own loop,
on the same engine the tabs use (so API requests show up in the panels next to them)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError

# serve(engine, host=..., port=..., api_key=..., ready=asyncio.Event) runs until cancelled.
ServeFn = Callable[..., Awaitable[Any]]


class EndpointError(LocalbatchError):
    """The embedded endpoint cannot start."""


def resolve_serve() -> ServeFn:
    try:
        from app.server import serve
    except ImportError as e:
        raise EndpointError(f"the embedded endpoint is unavailable: app.server cannot be imported ({e})") from None
    return serve


class EmbeddedEndpoint:
    def __init__(
        self,
        engine: EngineClient,
        host: str,
        port: int,
        api_key: str | None = None,
        serve_fn: ServeFn | None = None,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.api_key = api_key
        self._serve_fn = serve_fn
        self._task: asyncio.Task | None = None
        self.error: str | None = None  # why the last run ended, if it failed

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, timeout: float = 20.0) -> str:
        """Start serving; returns the base URL once the server is listening. Raises EndpointError."""
        if self.running:
            return self.address
        serve = self._serve_fn or resolve_serve()
        ready = asyncio.Event()
        self.error = None
        self._task = asyncio.create_task(self._run(serve, ready), name="localbatch-endpoint")
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({self._task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task in done:
            self._task = None
            raise EndpointError(self.error or f"the endpoint on {self.address} stopped at start-up")
        if not done:
            await self.stop()
            raise EndpointError(f"the endpoint on {self.address} did not start within {timeout:.0f} s")
        return self.address

    async def _run(self, serve: ServeFn, ready: asyncio.Event) -> None:
        try:
            await serve(self.engine, host=self.host, port=self.port, api_key=self.api_key, ready=ready)
        except SystemExit:
            # uvicorn exits the process when it cannot bind; here that must only end the endpoint.
            self.error = f"cannot listen on {self.host}:{self.port} (port in use?); pick another with --port"
        except OSError as e:
            self.error = f"cannot listen on {self.host}:{self.port}: {e.strerror or e}"
        except LocalbatchError as e:
            self.error = str(e)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task})  # waits without re-raising the task's cancellation here
