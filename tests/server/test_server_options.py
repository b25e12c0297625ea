"""Server options and route aliases: CORS, --served-model-name, routes without /v1, the
context_length_exceeded code."""

from __future__ import annotations

import httpx
import openai
import pytest

from app.server import ServeError, cors_policy
from tests.support.fake_engine import FakeEngine, ServerThread

USER = [{"role": "user", "content": "hi"}]
ORIGIN = "http://localhost:3000"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_preflight_needs_no_key_and_responses_carry_the_headers() -> None:
    with ServerThread(FakeEngine(), api_key="sekrit", cors=cors_policy([ORIGIN])) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        ok = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1},
                    headers={"Origin": ORIGIN, "Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        # A browser can read why it was refused.
        refused = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        other = c.options("/v1/models", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default() -> None:
    with ServerThread(FakeEngine(), api_key="sekrit") as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.options("/v1/chat/completions", headers=PREFLIGHT).status_code == 401
        r = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_flags_take_lists_and_vllm_json_lists() -> None:
    assert cors_policy(None) is None and cors_policy([]) is None
    policy = cors_policy(['["http://a", "http://b"]', "http://c"], ["GET", "POST"])
    assert policy is not None and policy.allowed_origins == ("http://a", "http://b", "http://c")
    assert policy.allowed_methods == ("GET", "POST") and policy.allowed_headers == ("*",)
    with pytest.raises(ServeError, match="--allowed-origins"):
        cors_policy(["[not json"])


def test_several_served_model_names() -> None:
    with ServerThread(FakeEngine(), served_model_name=["alias", "gpt-4o-mini"]) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=10)
        assert [m.id for m in oai.models.list().data] == ["alias", "gpt-4o-mini"]
        for name in ("alias", "gpt-4o-mini"):
            reply = oai.chat.completions.create(model=name, messages=USER, max_tokens=1)  # type: ignore[arg-type]
            assert reply.model == name
        with pytest.raises(openai.NotFoundError, match="'alias', 'gpt-4o-mini'"):
            oai.completions.create(model="fake-model", prompt="x", max_tokens=1)


def test_without_served_names_the_engines_current_name_is_read_per_request() -> None:
    engine = FakeEngine(model_name="first")
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "first"
        engine.model_name = "second"  # the app switched models
        assert c.get("/v1/models").json()["data"][0]["id"] == "second"
        r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "model": "second"})
        assert r.status_code == 200 and r.json()["model"] == "second"
        assert c.post("/v1/completions", json={"prompt": "x", "model": "first"}).status_code == 404


def test_routes_without_the_v1_prefix() -> None:
    with ServerThread(FakeEngine()) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/models").json()["data"][0]["id"] == "fake-model"
        assert c.get("/models/fake-model").json()["id"] == "fake-model"
        chat = c.post("/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        done = c.post("/completions", json={"prompt": "x", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["object"] == "text_completion"
        oai = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=10)
        assert oai.chat.completions.create(model="fake-model", messages=USER, max_tokens=1).choices  # type: ignore[arg-type]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ("/v1/completions", {"prompt": "x" * 600}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
])
def test_context_length_exceeded(path: str, body: dict[str, object], param: str) -> None:
    with ServerThread(FakeEngine(max_model_len=512)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        for stream in (False, True):
            error = c.post(path, json={**body, "stream": stream}).json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert c.post(path, json={"prompt": "x", "messages": USER, "max_tokens": 1}).status_code == 200
