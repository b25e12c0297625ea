"""What a request whose prompt does not fit the context gets: OpenAI's 400 by default; with vLLM's
`truncate_prompt_tokens` the prompt's last k tokens; with localbatch's `context_overflow:
"drop_oldest"` (chat) the conversation less its oldest turns, said in a response header. A prompt
the server counted or cut goes to the engine as the token ids it counted: tokenized once."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.fake_engine import FakeEngine, FakeTokenizer, ServerThread

TOK = FakeTokenizer()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONTEXT = 256
MAX_TOKENS = 8
DROPPED = "x-localbatch-dropped-messages"
SYSTEM = {"role": "system", "content": "You are terse."}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=CONTEXT, step_delay=0.001, eos_after=4)


def conversation(turns: int, last: str = "and now?") -> list[dict[str, str]]:
    """A system prompt, `turns` answered turns of about 120 tokens, and a new question."""
    messages = [SYSTEM]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " + "x" * 50},
                     {"role": "assistant", "content": f"answer {i} " + "y" * 50}]
    return [*messages, {"role": "user", "content": last}]


def templated(messages: list[dict[str, Any]]) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(messages))


def fewest_dropped(messages: list[dict[str, str]], budget: int) -> list[dict[str, str]]:
    """The conversation less the fewest oldest turns (user + reply) that makes it fit `budget`."""
    rest = messages[1:]
    while len(templated([SYSTEM, *rest])) > budget:
        rest = rest[2:]
    return [SYSTEM, *rest]


def chat(client: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    return client.post(CHAT, json={"messages": messages, "max_tokens": MAX_TOKENS, **extra})


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


# --- the default: OpenAI's 400 -----------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"context_overflow": "error"}])
def test_default_over_long_chat_is_a_400(client: httpx.Client, engine: FakeEngine, extra: dict[str, str]) -> None:
    before = len(engine.submitted)
    error = error_of(chat(client, conversation(4), **extra))
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert len(engine.submitted) == before


def test_a_chat_that_fits_is_sent_whole_without_the_header(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(1)
    r = chat(client, messages, context_overflow="drop_oldest")
    assert r.status_code == 200, r.text
    assert DROPPED not in r.headers
    assert engine.submitted[-1].prompt == templated(messages)


# --- context_overflow: "drop_oldest" -------------------------------------------------------------


def test_drop_oldest_drops_the_oldest_turns_and_says_how_many(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    expected = fewest_dropped(messages, CONTEXT - MAX_TOKENS)
    r = chat(client, messages, context_overflow="drop_oldest")
    assert r.status_code == 200, r.text
    assert expected[0] == SYSTEM and expected[-1] == messages[-1] and messages[1] not in expected
    assert engine.submitted[-1].prompt == templated(expected)  # the oldest question went
    assert r.headers[DROPPED] == str(len(messages) - len(expected)) == "6"  # three of the four turns
    assert r.json()["usage"]["prompt_tokens"] == len(templated(expected))


def test_drop_oldest_without_max_tokens_leaves_one_token(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    r = client.post(CHAT, json={"messages": messages, "context_overflow": "drop_oldest"})
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt == templated(fewest_dropped(messages, CONTEXT - 1))
    assert int(r.headers[DROPPED]) >= 2


def test_drop_oldest_when_the_last_message_alone_is_too_long(client: httpx.Client, engine: FakeEngine) -> None:
    before = len(engine.submitted)
    error = error_of(chat(client, conversation(2, last="z" * CONTEXT), context_overflow="drop_oldest"))
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "last message alone" in error["message"]
    assert len(engine.submitted) == before


def test_drop_oldest_streams_with_the_header(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "context_overflow": "drop_oldest", "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers[DROPPED] == "6"
        text = r.read().decode()
    events = [block.removeprefix("data: ") for block in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens"] == len(templated(fewest_dropped(messages, CONTEXT - MAX_TOKENS)))
    assert engine.submitted[-1].prompt == templated(fewest_dropped(messages, CONTEXT - MAX_TOKENS))


def test_drop_oldest_counts_the_tools_prompt() -> None:
    """The fallback's tool instructions are part of the prompt: counted without them, too few turns
    would go and the engine would refuse the rest."""
    engine = FakeEngine(max_model_len=1024, step_delay=0.001, eos_after=4)
    messages = conversation(12)
    with ServerThread(engine) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        r = chat(c, messages, context_overflow="drop_oldest", tools=[TOOL])
    assert r.status_code == 200, r.text
    sent = TOK.decode(engine.submitted[-1].prompt)
    assert sent.startswith("<system>") and "get_weather" in sent
    assert sent.endswith(f"<user>{messages[-1]['content']}\n<assistant>")
    used, turn = r.json()["usage"]["prompt_tokens"], len(TOK.apply_chat_template(messages[1:3], False))
    assert used + MAX_TOKENS <= 1024 < used + MAX_TOKENS + turn  # one turn more would not have fit
    kept = 1 + sent.count("<user>") + sent.count("<assistant>") - 1  # the system prompt; the last is the reply's
    assert r.headers[DROPPED] == str(len(messages) - kept)


@pytest.mark.parametrize("value", ["truncate", "stop", 1, None, True])
def test_unknown_overflow_policy_is_a_400(client: httpx.Client, value: Any) -> None:
    error = error_of(chat(client, conversation(0), context_overflow=value))
    assert error["param"] == "context_overflow"


# --- truncate_prompt_tokens -----------------------------------------------------------------------


LONG_TEXT = "hello world " * 40  # 480 bytes: over the context


def test_completion_keeps_the_last_k_tokens(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post(COMPLETIONS, json={"prompt": LONG_TEXT, "max_tokens": MAX_TOKENS, "truncate_prompt_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 10
    assert engine.submitted[-1].prompt == TOK.encode(LONG_TEXT)[-10:]


def test_completion_token_ids_and_batches_are_cut_each(client: httpx.Client, engine: FakeEngine) -> None:
    prompts = [list(range(3, 60)), list(range(100, 104))]
    before = len(engine.submitted)
    r = client.post(COMPLETIONS, json={"prompt": prompts, "max_tokens": MAX_TOKENS, "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    assert sorted(s.prompt for s in engine.submitted[before:]) == sorted([prompts[0][-5:], prompts[1]])
    assert r.json()["usage"]["prompt_tokens"] == 5 + 4


def test_a_shorter_prompt_is_sent_whole_and_echoed_as_written(client: httpx.Client, engine: FakeEngine) -> None:
    body = {"prompt": "hi", "max_tokens": MAX_TOKENS, "truncate_prompt_tokens": 50, "echo": True}
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt == TOK.encode("hi")  # counted here: the engine reads the ids
    assert r.json()["choices"][0]["text"].startswith("hi")


@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, None])
def test_minus_one_keeps_as_many_as_fit(client: httpx.Client, max_tokens: int | None) -> None:
    body = {"prompt": LONG_TEXT, "max_tokens": max_tokens, "truncate_prompt_tokens": -1}
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == CONTEXT - (max_tokens or 1)


def test_chat_is_templated_then_cut(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    r = chat(client, messages, truncate_prompt_tokens=20)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    assert engine.submitted[-1].prompt == templated(messages)[-20:]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True, CONTEXT + 1])
def test_invalid_truncation_is_a_400(client: httpx.Client, path: str, value: Any) -> None:
    body: dict[str, Any] = {"messages": conversation(0)} if path == CHAT else {"prompt": "hi"}
    error = error_of(client.post(path, json={**body, "truncate_prompt_tokens": value}))
    assert error["param"] == "truncate_prompt_tokens"
    assert error["message"].startswith("truncate_prompt_tokens")


def test_truncation_after_dropping_turns(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    r = chat(client, messages, context_overflow="drop_oldest", truncate_prompt_tokens=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 30 and r.headers[DROPPED] == "6"
    assert engine.submitted[-1].prompt == templated(fewest_dropped(messages, CONTEXT - MAX_TOKENS))[-30:]


def test_drop_oldest_then_truncation_cuts_the_ids_it_counted(client: httpx.Client, engine: FakeEngine) -> None:
    messages = conversation(4)
    rendered: list[int] = []
    render = engine.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> str:
        rendered.append(1)
        return render(*args, **kwargs)

    engine.apply_chat_template = counting  # type: ignore[method-assign]
    try:
        r = chat(client, messages, context_overflow="drop_oldest", truncate_prompt_tokens=20)
    finally:
        del engine.apply_chat_template
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt == templated(fewest_dropped(messages, CONTEXT - MAX_TOKENS))[-20:]
    # Each render counted a candidate; the kept one is not rendered again, by the server or the engine.
    assert len(rendered) <= 4
