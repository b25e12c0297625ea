"""Fill-in-the-middle code completion: finding a model's FIM tokens, llama.cpp's prompt layout and
budgets, `suffix` on /v1/completions and llama.cpp's /infill route, over the fake engine playing a
code model (its FIM tokens decode to Qwen2.5-Coder's texts); one slow test over the real
Qwen2.5-Coder 0.5B when it is pulled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.engine.text.fim import find_fim_tokens
from app.engine.types.fim import FimTokens
from app.server.fim import CHUNK_SEPARATOR, ExtraChunk, build_fim_prompt
from app.server.infill import indent_cut, pick_fields
from tests.support.fake_engine import FAKE_FIM, FIM_TEXTS, FakeEngine, FakeTokenizer, ServerThread

TOK = FakeTokenizer(FIM_TEXTS)
PRE, MID, SUF, PAD, REPO, SEP = 259, 260, 261, 262, 263, 264
BOS = FakeTokenizer.BOS
# Before every prompt of a model with repo and file-separator tokens, without extra chunks.
HEADER = [REPO, *TOK.encode("myproject\n", add_bos=False), SEP, *TOK.encode("filename\n", add_bos=False)]


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(fim=True, max_model_len=512, step_delay=0.002)


# --- finding the tokens ---------------------------------------------------------------------------

def vocab(*texts: str) -> dict[str, int]:
    return {t: 100 + i for i, t in enumerate(texts)}


def test_metadata_ids_come_first() -> None:
    meta = {"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.fim_suf_token_id": 8,
            "tokenizer.ggml.fim_mid_token_id": 9, "tokenizer.ggml.fim_sep_token_id": 10}
    texts = vocab("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>")
    assert find_fim_tokens(meta, texts.get, 200) == FimTokens(7, 8, 9, pad=103, repo=None, sep=10)


def test_an_unset_or_out_of_range_metadata_id_falls_back_to_the_texts() -> None:
    meta = {"tokenizer.ggml.fim_pre_token_id": -1, "tokenizer.ggml.fim_suf_token_id": 5000,
            "tokenizer.ggml.middle_token_id": 9}  # llama.cpp's older key
    texts = vocab("<|fim_prefix|>", "<|fim_suffix|>")
    assert find_fim_tokens(meta, texts.get, 200) == FimTokens(100, 101, 9)


@pytest.mark.parametrize(("texts", "expected"), [
    (("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
     FimTokens(100, 102, 101, pad=103, repo=104, sep=105)),  # Qwen2.5-Coder
    (("▁<PRE>", "▁<SUF>", "▁<MID>"), FimTokens(100, 101, 102)),  # CodeLlama
    (("<PRE>", "<SUF>", "<MID>"), FimTokens(100, 101, 102)),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<reponame>"),
     FimTokens(100, 101, 102, pad=103, repo=104)),  # StarCoder
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), FimTokens(100, 101, 102)),  # DeepSeek-Coder
    (("<fim-prefix>", "<fim-suffix>", "<fim-middle>"), FimTokens(100, 101, 102)),
])
def test_known_family_texts(texts: tuple[str, ...], expected: FimTokens) -> None:
    assert find_fim_tokens({}, vocab(*texts).get, 200) == expected


def test_a_model_without_all_three_has_none() -> None:
    assert find_fim_tokens({}, vocab("<|im_start|>", "<|im_end|>").get, 200) is None
    assert find_fim_tokens({}, vocab("<|fim_prefix|>", "<|fim_suffix|>").get, 200) is None


def test_end_ids_are_the_optional_tokens() -> None:
    assert FAKE_FIM.end_ids == [PAD, REPO, SEP]
    assert FimTokens(1, 2, 3).end_ids == []


# --- the prompt --------------------------------------------------------------------------------

def test_layout_with_repo_and_file_separators() -> None:
    built = build_fim_prompt(enc, FAKE_FIM, "def f(", ")\n", prompt="  x",
                             extra=[ExtraChunk("A = 1\n", "a.py"), ExtraChunk("B = 2\n")], max_model_len=4096)
    assert built.token_ids == [REPO, *enc("myproject\n"), SEP, *enc("a.py\n"), *enc("A = 1\n"),
                               SEP, *enc("tmp\n"), *enc("B = 2\n"), SEP, *enc("filename\n"),
                               PRE, *enc("def f("), *enc("  x"), SUF, *enc(")\n"), MID]
    assert not built.truncated


def test_layout_without_repo_tokens_bos_first_and_spm_order() -> None:
    fim = FimTokens(PRE, SUF, MID)
    built = build_fim_prompt(enc, fim, "a", "b", extra=[ExtraChunk("x")], bos=[BOS])
    assert built.token_ids == [BOS, *enc(CHUNK_SEPARATOR), *enc("x"), PRE, *enc("a"), SUF, *enc("b"), MID]
    spm = build_fim_prompt(enc, fim, "a", "b", spm_order=True)
    assert spm.token_ids == [SUF, *enc("b"), PRE, *enc("a"), MID]


def test_budgets_keep_the_end_of_the_prefix_and_the_start_of_the_suffix() -> None:
    # A 64-token context: a 32-token window, 24 for the prefix, 8 - 2 - prompt for the suffix.
    built = build_fim_prompt(enc, FimTokens(PRE, SUF, MID), "p" * 50 + "END", "START" + "s" * 50, prompt="ab",
                             max_model_len=64)
    ids = built.token_ids
    assert ids[0] == PRE and ids[-1] == MID
    prefix, suffix = TOK.decode(ids[1:ids.index(SUF)]), TOK.decode(ids[ids.index(SUF) + 1:-1])
    assert prefix == "p" * 21 + "END" + "ab"
    assert suffix == "STAR"


def test_extra_chunks_keep_their_end_and_report_truncation() -> None:
    chunks = [ExtraChunk("old " * 100, "old.py"), ExtraChunk("new\n", "new.py")]
    built = build_fim_prompt(enc, FAKE_FIM, "x", "y", extra=chunks, max_model_len=1024, n_predict=100)
    # 1024 - 512 (window) - 2 * 100 = 312 extra tokens: the old chunk's end and everything after it.
    assert built.truncated
    text = TOK.decode(built.token_ids[:built.token_ids.index(PRE)])
    assert text.endswith("old <|file_sep|>new.py\nnew\n<|file_sep|>filename\n")
    assert "<|repo_name|>" not in text and len(built.token_ids[:built.token_ids.index(PRE)]) == 312


# --- /v1/completions with suffix (the fake tokenizer adds a BOS, so the prompts start with one) ---

def test_suffix_sends_the_fim_prompt(client: httpx.Client, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": "def add(a, b):\n    return ", "suffix": "\nprint(1)\n",
                                             "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    submitted = engine.submitted[-1]
    assert submitted.prompt == [BOS, *HEADER, PRE, *enc("def add(a, b):\n    return "), SUF, *enc("\nprint(1)\n"), MID]
    assert set(FAKE_FIM.end_ids) <= set(submitted.params.stop_token_ids)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"]) == 5
    assert r.json()["usage"]["prompt_tokens"] == len(submitted.prompt)


def test_suffix_streams_with_n_stop_and_logprobs(client: httpx.Client, engine: FakeEngine) -> None:
    body = {"prompt": ["x = ", "y = "], "suffix": "", "max_tokens": 6, "n": 2, "stream": True, "logprobs": 1,
            "seed": 3, "stop": ["zzz"]}
    before = len(engine.submitted)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    prompts = [s.prompt for s in engine.submitted[before:]]
    assert prompts == [[BOS, *HEADER, PRE, *enc("x = "), SUF, MID]] * 2 + [[BOS, *HEADER, PRE, *enc("y = "), SUF, MID]] * 2
    events = sse_data(r.text.removesuffix("data: [DONE]\n\n"))
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1, 2, 3}
    assert any(c["logprobs"] for e in events for c in e["choices"])


@pytest.mark.parametrize(("extra", "param"), [({"echo": True}, "echo"),
                                              ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
                                              ({"suffix": 5}, "suffix")])
def test_suffix_combinations_that_are_refused(client: httpx.Client, extra: dict[str, Any], param: str) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "suffix": "y", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_model_without_fim_tokens_refuses_suffix_and_infill() -> None:
    with ServerThread(FakeEngine()) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "suffix": "y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
        assert "fill-in-the-middle" in r.json()["error"]["message"]
        r = c.post("/infill", json={"input_prefix": "x", "input_suffix": "y"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"], r.text


# --- /infill -------------------------------------------------------------------------------------

INFILL = {"input_prefix": "def f():\n", "input_suffix": "\n", "prompt": "    ret", "n_predict": 4, "temperature": 0}


def test_infill_prompt_and_response(client: httpx.Client, engine: FakeEngine) -> None:
    body = {**INFILL, "input_extra": [{"filename": "a.py", "text": "A = 1\n", "time": 123}]}
    r = client.post("/infill", json=body)
    assert r.status_code == 200, r.text
    prompt = engine.submitted[-1].prompt
    assert prompt == [BOS, REPO, *enc("myproject\n"), SEP, *enc("a.py\nA = 1\n"), SEP, *enc("filename\n"),
                      PRE, *enc("def f():\n    ret"), SUF, *enc("\n"), MID]
    out = r.json()
    assert len(out["content"]) == 4 and out["stop"] is True
    assert (out["stop_type"], out["stopping_word"], out["truncated"]) == ("limit", "", False)
    assert (out["tokens_predicted"], out["tokens_evaluated"]) == (4, len(prompt))
    assert out["model"] == "fake-model" and out["generation_settings"]["n_predict"] == 4
    timings = out["timings"]
    assert timings["predicted_n"] == 4 and timings["prompt_n"] == len(prompt) - timings["cache_n"]
    assert out["tokens_cached"] == len(prompt) + 4  # llama-server's meaning: what the cache holds
    for key in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second", "prompt_per_token_ms",
                "predicted_per_token_ms", "cache_n"):
        assert isinstance(timings[key], (int, float)) and timings[key] >= 0, key


def test_the_users_text_is_tokenized_without_special_tokens(client: httpx.Client, engine: FakeEngine) -> None:
    """As llama.cpp's format_infill: "<|fim_middle|>" written in a file is text, not the token."""
    assert client.post("/infill", json={**INFILL, "input_prefix": "s = '<|fim_middle|>'\n"}).status_code == 200
    assert ("s = '<|fim_middle|>'\n", False) in engine.encoded


def test_a_repeated_request_is_served_by_the_prefix_cache(client: httpx.Client) -> None:
    body = {**INFILL, "input_extra": [{"text": "common context\n" * 10}]}
    client.post("/infill", json=body)
    out = client.post("/infill", json=body).json()
    assert out["timings"]["cache_n"] >= 16
    assert out["timings"]["prompt_n"] == out["tokens_evaluated"] - out["timings"]["cache_n"]


def test_streaming_infill_matches_the_whole_response(client: httpx.Client) -> None:
    whole = client.post("/infill", json=INFILL).json()
    r = client.post("/infill", json={**INFILL, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_data(r.text)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["content"] == "" and events[-1]["timings"]["predicted_n"] == 4


def test_stop_word_and_response_fields(client: httpx.Client) -> None:
    r = client.post("/infill", json={**INFILL, "n_predict": 40, "stop": " ",
                                     "response_fields": ["content", "stop_type", "stopping_word",
                                                         "timings/prompt_n", "timings/nonexistent"]})
    out = r.json()
    assert set(out) == {"content", "stop_type", "stopping_word", "timings/prompt_n"}, out
    assert (out["stop_type"], out["stopping_word"]) == ("word", " ") and " " not in out["content"]


def test_n_predict_unlimited_and_zero(client: httpx.Client, engine: FakeEngine) -> None:
    out = client.post("/infill", json={**INFILL, "n_predict": -1}).json()
    assert out["tokens_predicted"] == engine.max_model_len - out["tokens_evaluated"]
    assert out["stop_type"] == "limit"
    # llama.vim's warm-up: the prompt is read (and cached), nothing comes back.
    out = client.post("/infill", json={**INFILL, "n_predict": 0}).json()
    assert (out["content"], out["tokens_predicted"]) == ("", 0)


@pytest.mark.parametrize("chunk", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}, "text", None])
def test_malformed_input_extra_chunks_are_400(client: httpx.Client, chunk: Any) -> None:
    r = client.post("/infill", json={**INFILL, "input_extra": [chunk]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input_extra" and r.json()["error"]["message"]


@pytest.mark.parametrize("body", [{**INFILL, "input_extra": {"text": "x"}}, {**INFILL, "input_extra": "x"},
                                  {"input_suffix": "x"}, {**INFILL, "prompt": 5}, {**INFILL, "n_predict": -2},
                                  {**INFILL, "temperature": -1}])
def test_malformed_infill_requests_are_400(client: httpx.Client, body: dict[str, Any]) -> None:
    r = client.post("/infill", json=body)
    assert r.status_code == 400 and "error" in r.json(), r.text


@pytest.fixture
def scripted() -> Iterator[tuple[FakeEngine, httpx.Client]]:
    """A code model whose replies are four lines of a function and then a line forever."""
    lines = ["    x = 1\n", "    y = 2\n", "z = 3\n"] + ["    w\n"] * 1000
    engine = FakeEngine(fim=True, max_model_len=4096, step_delay=0.005, script=lambda _: list(lines))
    with ServerThread(engine) as server, httpx.Client(base_url=server.url, timeout=10) as c:
        yield engine, c


def test_n_indent_cuts_at_a_shallower_line(scripted: tuple[FakeEngine, httpx.Client]) -> None:
    engine, c = scripted
    out = c.post("/infill", json={**INFILL, "n_indent": 4, "n_predict": 20}).json()
    assert out["content"] == "    x = 1\n    y = 2\n" and out["stop_type"] == "limit", out
    deadline = time.monotonic() + 5
    while engine.live_request_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.live_request_ids() == [] and engine.aborted


def test_t_max_predict_ms_stops_after_a_newline(scripted: tuple[FakeEngine, httpx.Client]) -> None:
    _, c = scripted
    start = time.monotonic()
    out = c.post("/infill", json={**INFILL, "n_predict": -1, "t_max_predict_ms": 100}).json()
    assert time.monotonic() - start < 3
    assert out["stop_type"] == "limit" and out["content"].startswith("    x = 1\n")
    assert 2 <= out["tokens_predicted"] < 200, out["tokens_predicted"]


def test_a_client_that_leaves_aborts_the_request(scripted: tuple[FakeEngine, httpx.Client]) -> None:
    engine, c = scripted
    with c.stream("POST", "/infill", json={**INFILL, "n_predict": -1, "stream": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted and engine.live_request_ids() == []


def test_indent_cut_and_pick_fields() -> None:
    assert indent_cut("a\n  b\n c", 0, 2) == 7
    assert indent_cut("a\n  b\n", 0, 2) is None
    assert indent_cut("a\n\n", 0, 1) == 2  # llama.cpp cuts at a blank line too
    assert pick_fields({"a": {"b": 1}, "c": 2}, ["a/b", "c", "a/x", ""]) == {"a/b": 1, "c": 2}


# --- the real model --------------------------------------------------------------------------------

LLAMA_CPP_INFILL_CASES = [
    {"input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
     "prompt": "    int n_threads = llama_", "input_suffix": "}\n"},
    {"input_extra": [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}],
     "input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
     "prompt": "    int n_threads = llama_", "input_suffix": "}\n"},
]


@pytest.mark.slow
def test_qwen_coder_fills_the_middle() -> None:
    from app.engine.api.async_engine import AsyncEngine
    from app.engine.gguf.catalog import installed_path

    model = "qwen2.5-coder-0.5b-instruct"
    if installed_path(model) is None:
        pytest.skip(f"Qwen2.5-Coder 0.5B is not pulled: run `localbatch pull {model}`")
    engine = AsyncEngine(model=model, device="cpu", kv_cache_blocks=64)
    try:
        assert engine.fim_tokens == FimTokens(151659, 151661, 151660, pad=151662, repo=151663, sep=151664)
        assert engine.encode("<|fim_middle|>", add_bos=False) == [151660]
        assert 151660 not in engine.encode("<|fim_middle|>", add_bos=False, parse_special=False)
        with ServerThread(engine) as server, httpx.Client(base_url=server.url, timeout=300) as c:
            body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
                    "n_predict": 8, "temperature": 0}
            out = c.post("/infill", json=body).json()
            assert out["content"].startswith("a + b"), out
            r = c.post("/v1/completions", json={"prompt": body["input_prefix"], "suffix": body["input_suffix"],
                                                "max_tokens": 8, "temperature": 0})
            assert r.json()["choices"][0]["text"].startswith("a + b"), r.text
            for case in LLAMA_CPP_INFILL_CASES:  # llama.cpp's tools/server/tests/unit/test_infill.py requests
                out = c.post("/infill", json={**case, "n_predict": 24, "temperature": 0}).json()
                assert out["content"], out
            out = c.post("/infill", json={**LLAMA_CPP_INFILL_CASES[1], "n_predict": 32, "temperature": 0}).json()
            # llama.cpp's expected middle for Qwen2.5-Coder 1.5B (its test_with_qwen_model): the 0.5B writes it too.
            assert out["content"].startswith('n_threads();\n    printf("Number of threads: %d\\n", n_threads);\n'
                                             '    return 0;\n'), out
            for chunk in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                          {"filename": 123, "text": 456}):
                r = c.post("/infill", json={**LLAMA_CPP_INFILL_CASES[0], "input_extra": [chunk]})
                assert r.status_code == 400 and "error" in r.json(), r.text
    finally:
        engine.close()
