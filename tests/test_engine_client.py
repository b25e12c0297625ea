"""Every engine the UI and the server can be handed implements the whole `EngineClient` protocol,
so clients use its members directly, never probing for them."""

from __future__ import annotations

import inspect

import pytest

from app.clients.remote import RemoteEngine
from app.engine.api.async_engine import AsyncEngine
from app.engine.api.engine_client import EngineClient
from tests.support.fake_engine import FakeEngine

MEMBERS = {"model_name", "max_model_len", "device", "dtype", "backend", "is_remote", "chat_template", "fim_tokens",
           "stats_source",
           "stream", "abort", "stats", "set_speculation", "clear_kv_disk_cache", "encode", "decode", "apply_chat_template", "aclose"}


def protocol_members() -> set[str]:
    own = {name for name in vars(EngineClient) if not name.startswith("_")}
    return own | set(EngineClient.__annotations__)


def declares(cls: type, name: str) -> bool:
    """A class attribute, method or property, or an annotation for one its `__init__` sets."""
    return any(name in vars(k) or name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def test_the_protocol_is_what_clients_use() -> None:
    assert protocol_members() == MEMBERS


@pytest.mark.parametrize("cls", [AsyncEngine, RemoteEngine, FakeEngine])
def test_every_engine_declares_every_member_with_the_same_signature(cls: type) -> None:
    for name in sorted(protocol_members()):
        assert declares(cls, name), f"{cls.__name__} does not declare {name}"
        wanted = vars(EngineClient).get(name)
        if not inspect.isfunction(wanted):
            continue
        got = getattr(cls, name)
        assert list(inspect.signature(got).parameters) == list(inspect.signature(wanted).parameters), name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name


def test_the_fake_and_the_remote_engine_are_engine_clients() -> None:
    fake = FakeEngine()
    assert isinstance(fake, EngineClient)
    assert (fake.is_remote, fake.stats_source) == (False, "")
    remote = RemoteEngine("http://gpu-box:8000/v1", "m")
    assert isinstance(remote, EngineClient)
    assert (remote.is_remote, remote.device, remote.dtype) == (True, "remote gpu-box:8000", "")
