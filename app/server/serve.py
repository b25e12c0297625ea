"""Running the app on uvicorn inside the caller's event loop (`localbatch serve`, or the TUI's endpoint thread).

uvicorn is driven through a socket bound here, so that a busy port or a refused host is an
exception the caller can show (uvicorn itself would `sys.exit`), and port 0 works. Signals stay
with the caller: cancelling `serve()` is how it stops."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import LocalbatchError
from app.server.factory import CorsPolicy, create_app

log = logging.getLogger(__name__)

# In-flight requests get this long to finish when the server stops; then they are cancelled
# (which aborts their engine requests).
GRACEFUL_SHUTDOWN_S = 2


class ServeError(LocalbatchError):
    """The server cannot start: refused host, address in use, bad port."""


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServeError(f"cannot resolve host {host!r}: {exc}") from exc
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to expose the engine beyond this machine without a key."""
    if not api_key and not is_loopback(host):
        raise ServeError(f"refusing to listen on {host} without an API key: pass --api-key KEY "
                         "(or bind 127.0.0.1)")


def cors_policy(origins: Sequence[str] | None, methods: Sequence[str] | None = None,
                headers: Sequence[str] | None = None) -> CorsPolicy | None:
    """From `--allowed-origins A B` (or vLLM's JSON-list spelling `'["A", "B"]'`) and the
    optional methods and headers; None (CORS off) without origins. Raises `ServeError` for a
    JSON list that does not parse."""
    if not origins:
        return None
    default = CorsPolicy()
    return CorsPolicy(_flag_values(origins, "--allowed-origins"),
                      _flag_values(methods, "--allowed-methods") or default.allowed_methods,
                      _flag_values(headers, "--allowed-headers") or default.allowed_headers)


def _flag_values(values: Sequence[str] | None, flag: str) -> tuple[str, ...]:
    out: list[str] = []
    for value in values or ():
        if not value.lstrip().startswith("["):
            out.append(value)
            continue
        try:
            items = json.loads(value)
        except ValueError as exc:
            raise ServeError(f"{flag}: {value!r} is not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ServeError(f"{flag}: {value!r} must be a JSON list of strings")
        out.extend(items)
    return tuple(out)


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to ("localhost" may be 127.0.0.1 and ::1),
    all on one port (the first one's when `port` is 0)."""
    if not 0 <= port <= 65535:
        raise ServeError(f"port {port} is out of range 0-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            if sockets:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sockets.append(_listen(family, kind, proto, address))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sockets


def _listen(family: int, kind: int, proto: int, address: tuple[Any, ...]) -> socket.socket:
    # proto must be IPPROTO_TCP (socket.create_server leaves 0): asyncio sets TCP_NODELAY only on
    # accepted sockets whose proto says TCP, and without it every small write (an SSE chunk, a
    # keep-alive POST) can wait ~40 ms for a delayed ACK.
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the caller's loop (asyncio.run, Textual) owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the name in uvicorn < 0.29's API
        pass


class ApiServer:
    """The app on uvicorn, started and stopped from the current event loop.

    `await start()` binds and returns once connections are accepted (`port` is then the real one,
    also for port 0); `await stop()` shuts down; `await wait()` returns when it has stopped."""

    def __init__(self, engine: EngineClient, host: str = "127.0.0.1", port: int = 8000, *,
                 api_key: str | None = None, served_model_name: str | Sequence[str] | None = None,
                 cors: CorsPolicy | None = None) -> None:
        check_exposure(host, api_key)
        self.host = host
        self.port = port
        self.app = create_app(engine, api_key=api_key, served_model_name=served_model_name, cors=cors)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        sockets = bind(self.host, self.port)
        self.port = sockets[0].getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=sockets), name=f"localbatch-api:{self.port}")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            for sock in sockets:
                sock.close()
            self._task.result()  # re-raises why uvicorn did not start
            raise ServeError(f"the server on {self.url} stopped while starting")
        log.info("OpenAI-compatible API on %s (model %s)", self.url, self.app.state.localbatch.model_name)

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop accepting, give in-flight requests GRACEFUL_SHUTDOWN_S, then cancel them."""
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait({self._task})


async def serve(engine: EngineClient, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                ready: asyncio.Event | None = None, *, served_model_name: str | Sequence[str] | None = None,
                cors: CorsPolicy | None = None) -> None:
    """Serve the OpenAI-compatible API in the current event loop until cancelled.

    Raises `ServeError` (one line) for a non-loopback host without `api_key` or an address that
    cannot be bound. Sets `ready` once connections are accepted."""
    server = ApiServer(engine, host, port, api_key=api_key, served_model_name=served_model_name, cors=cors)
    try:
        await server.start()
        if ready is not None:
            ready.set()
        await server.wait()
    finally:
        await server.stop()
