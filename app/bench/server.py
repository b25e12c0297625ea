"""Servers for the HTTP benchmarks: a free loopback port, `localbatch serve` (or any server
command) started and waited for, stopped again; `/metrics` read once or scraped on a thread."""

from __future__ import annotations

import contextlib
import http.client
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

from app.clients.prometheus_text import parse_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def localbatch_serve_cmd(engine_argv: list[str], port: int) -> list[str]:
    """`localbatch serve` on a loopback port, run by this interpreter (the checkout's or the install's)."""
    return [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *engine_argv]


def _answers(url: str) -> bool:
    for path in ("/health", "/v1/models"):
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as r:
                if r.status == 200:
                    return True
    return False


def start_server(cmd: list[str], url: str, timeout: float = 300, quiet: bool = True) -> subprocess.Popen:
    """Start `cmd` and wait until `url` answers /health or /v1/models with 200; killed and an
    error raised if it exits or does not answer within `timeout` seconds. Its stdout is dropped,
    its stderr too when `quiet`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if quiet else None)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _answers(url):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}")
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate (after SIGCONT, in case a paired run left it stopped); kill if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running(cmd: list[str], url: str, timeout: float = 300) -> Iterator[subprocess.Popen]:
    proc = start_server(cmd, url, timeout)
    try:
        yield proc
    finally:
        stop_server(proc)


def fetch_counters(url: str) -> dict[str, float]:
    """One scrape of `url`/metrics, as `parse_metrics` keys."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


class Scraper:
    """GETs /metrics every `period` s on its own thread over one kept-alive connection, keeping
    each scrape's latency and the last scrape's counters. The stdlib client: httpx alone added
    more to a request than the server's answer took (docs/tuning.md)."""

    def __init__(self, url: str, period: float) -> None:
        self.url, self.period = url, period
        self.latencies: list[float] = []
        self.counters: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        address = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read()
                if response.status == 200:
                    self.latencies.append(time.perf_counter() - t0)
                    self.counters = parse_metrics(body.decode())
            except (OSError, http.client.HTTPException):  # still starting
                conn.close()
            self._stop.wait(max(0.0, self.period - (time.perf_counter() - t0)))
        conn.close()

    def summary(self) -> str:
        if not self.latencies:
            return "no scrapes"
        ms = sorted(1e3 * x for x in self.latencies)
        return f"{len(ms)} scrapes, p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms"
