"""The embedded OpenAI-compatible endpoint: `app.server.serve` on the same engine the tabs use (so
API requests show up in the panels next to them), on a thread with its own event loop. On the
app's loop a scrape or a stream's next chunk waited for whatever frame or layout the UI was
drawing (tens of milliseconds now and then), and the UI's frames waited for the requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
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
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None  # the serving, in the endpoint's loop
        self.error: str | None = None  # why the last run ended, if it failed

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self, timeout: float = 20.0) -> str:
        """Start serving; returns the base URL once the server is listening. Raises EndpointError."""
        if self.running:
            return self.address
        serve = self._serve_fn or resolve_serve()
        self.error = None
        listening: concurrent.futures.Future[bool] = concurrent.futures.Future()  # False: ended first
        self._loop = loop = asyncio.new_event_loop()
        self._task = loop.create_task(self._run(serve, listening))
        self._thread = threading.Thread(target=_run_loop, args=(loop, self._task), name="localbatch-endpoint",
                                        daemon=True)
        self._thread.start()
        try:
            started = await asyncio.wait_for(asyncio.wrap_future(listening), timeout)
        except TimeoutError:
            await self.stop()
            raise EndpointError(f"the endpoint on {self.address} did not start within {timeout:.0f} s") from None
        if not started:
            await self.stop()
            raise EndpointError(self.error or f"the endpoint on {self.address} stopped at start-up")
        return self.address

    async def _run(self, serve: ServeFn, listening: concurrent.futures.Future[bool]) -> None:
        ready = asyncio.Event()
        signal = asyncio.create_task(ready.wait())
        signal.add_done_callback(lambda t: t.cancelled() or listening.done() or listening.set_result(True))
        try:
            await serve(self.engine, host=self.host, port=self.port, api_key=self.api_key, ready=ready)
        except SystemExit:
            # uvicorn exits the process when it cannot bind; here that must only end the endpoint.
            self.error = f"cannot listen on {self.host}:{self.port} (port in use?); pick another with --port"
        except OSError as e:
            self.error = f"cannot listen on {self.host}:{self.port}: {e.strerror or e}"
        except LocalbatchError as e:
            self.error = str(e)
        except Exception as e:  # a bug: the panel says that the endpoint stopped, and why
            self.error = f"stopped unexpectedly ({type(e).__name__}: {e})"
        finally:
            signal.cancel()
            if not listening.done():
                listening.set_result(False)

    async def stop(self) -> None:
        """Stop serving (in-flight requests get the server's grace period) and end the thread."""
        thread, loop, task = self._thread, self._loop, self._task
        self._thread = self._loop = self._task = None
        if thread is None or loop is None or task is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed: the serving had ended
            loop.call_soon_threadsafe(task.cancel)
        await asyncio.to_thread(thread.join)


def _run_loop(loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(asyncio.wait({task}))  # a cancelled task ends the loop quietly
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
