"""The HTTP server over each module's `engine` fixture, and clients for it. A module that needs
another set-up (the fuzz tests, the real model) defines its own `server` / `client`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.fake_engine import FakeEngine, ServerThread


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[ServerThread]:
    with ServerThread(engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
