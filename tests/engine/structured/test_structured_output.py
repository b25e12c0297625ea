"""Structured output and logit_bias through the engine: tiny random-weight GGUFs (their own small
tokenizers: SentencePiece with byte fallback for gemma3, byte-level BPE for qwen3) and, where real
weights matter, the pulled SmolLM2 chat model.

Random weights emit whitespace wherever JSON allows it, so the JSON tests ban whitespace tokens
with logit_bias to keep outputs short: the grammar still decides everything else."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.core.sequence import Sequence
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import GROUPS

SEEDS = range(4)
PROMPT = "hello world"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 4}, "zip": {"type": "string", "pattern": "[0-9]{3}"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "role", "address", "scores"],
    "additionalProperties": False,
}
# Short tags: the tiny vocabularies spell them a character at a time.
TOOL_CALL = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [{
            "type": "tag",
            "begin": "<f>",
            "content": {"type": "json_schema", "json_schema": {
                "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                "additionalProperties": False}},
            "end": "</f>",
        }],
        "at_least_one": True,
        "stop_after_first": True,
    },
}


def make_engine(path, **kw) -> LLMEngine:
    settings = {"device": "cpu", "dtype": "float32", "block_size": 4, "kv_cache_blocks": 256 * GROUPS,
                "max_num_batched_tokens": 512}
    settings.update(kw)
    return LLMEngine(str(path), **settings)


def run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list[Sequence]:
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return seqs


def text(engine: LLMEngine, seq: Sequence) -> str:
    return engine.plan.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


def seeded(n: int = len(SEEDS), **params) -> list[SamplingParams]:
    base = {"max_tokens": 120, "temperature": 0.8}
    return [SamplingParams(**{**base, "seed": s, **params}) for s in range(n)]


def no_whitespace(engine: LLMEngine) -> dict[int, float]:
    tok = engine.plan.tokenizer
    return {i: -100.0 for i in range(tok.vocab_size) if tok.token_to_bytes(i) and not tok.token_to_bytes(i).strip()}


@pytest.fixture(scope="module")
def gemma_path(tiny_gguf_factory):
    return tiny_gguf_factory("gemma3")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return make_engine(gemma_path)


@pytest.fixture(scope="module")
def qwen(tiny_gguf_factory):
    return make_engine(tiny_gguf_factory("qwen3"))


# --- each kind of constraint ---


def test_json_schema_output_validates(gemma):
    seqs = run(gemma, [PROMPT] * len(SEEDS), seeded(json_schema=PERSON, logit_bias=no_whitespace(gemma)))
    for seq in seqs:
        assert seq.finish_reason == "stop", text(gemma, seq)
        jsonschema.validate(json.loads(text(gemma, seq)), PERSON)
    assert len({text(gemma, s) for s in seqs}) > 1  # the seeds really sampled


def test_json_schema_as_text_is_the_same_constraint(gemma):
    gemma.make_sequence(PROMPT, SamplingParams(max_tokens=10, json_schema=PERSON))
    cached = gemma.inputs.constraints.num_cached
    gemma.make_sequence(PROMPT, SamplingParams(max_tokens=10, json_schema=json.dumps(PERSON, indent=2)))
    assert gemma.inputs.constraints.num_cached == cached  # one compiled grammar for both spellings


@pytest.mark.parametrize("engine_name", ["gemma", "qwen"])
def test_regex_output_matches(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    pattern = r"[a-c]{3}-[0-9]{2}(!|\?)"
    for seq in run(engine, [PROMPT] * len(SEEDS), seeded(regex=pattern)):
        assert seq.finish_reason == "stop" and re.fullmatch(pattern, text(engine, seq))


def test_ebnf_grammar_output_matches(gemma):
    grammar = 'root ::= answer " " [0-9]{1,3} "."\nanswer ::= "yes" | "no"'
    for seq in run(gemma, [PROMPT] * len(SEEDS), seeded(grammar=grammar, max_tokens=60)):
        out = text(gemma, seq)
        assert seq.finish_reason == "stop" and re.fullmatch(r"(yes|no) [0-9]{1,3}\.", out), out


def test_json_object_gives_an_object(qwen):
    for seq in run(qwen, [PROMPT] * 2, seeded(2, json_object=True, logit_bias=no_whitespace(qwen))):
        assert seq.finish_reason == "stop" and isinstance(json.loads(text(qwen, seq)), dict)


def test_structural_tag_tool_call(gemma):
    for seq in run(gemma, [PROMPT] * 2, seeded(2, structural_tag=TOOL_CALL, logit_bias=no_whitespace(gemma))):
        out = text(gemma, seq)
        m = re.fullmatch(r"<f>(.*)</f>", out, re.DOTALL)
        assert seq.finish_reason == "stop" and m, out
        assert json.loads(m.group(1))["city"] in ("Paris", "Rome")


# --- errors ---


@pytest.mark.parametrize("field,value,words", [
    ("json_schema", {"type": "frob"}, "frob"),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("json_schema", {"type": "string", "pattern": "(("}, "parenthesis"),
    ("regex", "a(b", "parenthesis"),
    ("grammar", "root ::= undefined_rule", "undefined_rule"),
    ("structural_tag", {"type": "structural_tag", "format": {"type": "nope"}}, "nope"),
    ("structural_tag", {"type": "structural_tag", "structures": "x", "triggers": []}, "structures"),
])
def test_invalid_constraint_is_a_request_error_naming_its_field(gemma, field, value, words):
    free = gemma.block_manager.num_free_blocks
    with pytest.raises(RequestError) as err:
        gemma.add_request(PROMPT, SamplingParams(max_tokens=10, **{field: value}))
    message = str(err.value)
    assert err.value.param == field and words in message and "\n" not in message and ".cc:" not in message
    assert not gemma.has_unfinished() and gemma.block_manager.num_free_blocks == free
    ok, = run(gemma, [PROMPT], seeded(1, regex="[ab]{2}"))  # the engine serves on
    assert re.fullmatch("[ab]{2}", text(gemma, ok))


def test_engine_without_tokenizer_rejects_constraints():
    from app.engine.structured.compiler import ConstraintCompiler

    with pytest.raises(RequestError) as err:
        ConstraintCompiler(None, 100).matcher_for(SamplingParams(regex="a"))
    assert err.value.param == "regex" and "tokenizer" in str(err.value)


# --- the engine around the grammar ---


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(gemma):
    prompts = ["the cat", "hello world and", "this is"]
    free = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, seed=8, ignore_eos=True, logit_bias={40: 5.0})]
    alone = [run(gemma, [p], [sp])[0].output_token_ids for p, sp in zip(prompts, free)]
    constrained = seeded(3, regex="[a-z]{4,8}", max_tokens=10)
    mixed = run(gemma, [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2], PROMPT],
                [free[0], constrained[0], free[1], constrained[1], free[2], constrained[2]])
    assert [s.output_token_ids for s in mixed[::2]] == alone
    assert all(re.fullmatch("[a-z]{4,8}", text(gemma, s)) for s in mixed[1::2])


def test_preemption_keeps_the_grammar_state(gemma_path):
    prompts = [PROMPT + " " + "the " * k for k in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=s, json_schema=PERSON) for s in range(6)]
    roomy = run(make_engine(gemma_path), prompts, params)
    tight = make_engine(gemma_path, kv_cache_blocks=20 * GROUPS)  # 80 slots per group for 6 requests of up to 60 tokens
    squeezed = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in squeezed] == [s.output_token_ids for s in roomy]
    assert tight.block_manager.num_free_blocks == 20 * GROUPS


def test_n_sequences_get_their_own_matchers_from_one_compiled_grammar(gemma):
    params = SamplingParams(max_tokens=30, temperature=1.0, regex="(ab|ba|c){2,5}")  # one params object, n=3
    before = gemma.inputs.constraints.num_cached
    seqs = [gemma.make_sequence(PROMPT, params) for _ in range(3)]
    assert gemma.inputs.constraints.num_cached == before + 1
    assert len({id(s.grammar) for s in seqs}) == 3
    for seq in seqs:
        gemma.add_sequence(seq)
    while gemma.has_unfinished():
        gemma.step()
    assert all(s.finish_reason == "stop" and re.fullmatch("(ab|ba|c){2,5}", text(gemma, s)) for s in seqs)


def test_max_tokens_cut_is_length(gemma):
    seq, = run(gemma, [PROMPT], seeded(1, regex="[a-z]{30}", max_tokens=5))
    assert seq.finish_reason == "length" and seq.num_output_tokens == 5


def test_stop_token_only_where_the_grammar_is_complete(gemma):
    eos = gemma.plan.tokenizer.eos_token_id
    for seq in run(gemma, [PROMPT] * 3, seeded(3, regex="[a-c]{3}", logit_bias={eos: 100.0})):
        assert seq.finish_reason == "stop" and seq.output_token_ids[-1] == eos
        assert re.fullmatch("[a-c]{3}", text(gemma, seq))


def test_finished_and_aborted_sequences_drop_their_matcher(gemma):
    done, = run(gemma, [PROMPT], seeded(1, regex="[ab]{2}"))
    assert done.grammar is None
    seq = gemma.add_request(PROMPT, SamplingParams(max_tokens=50, regex="[ab]{40}"))
    gemma.step()
    assert seq.grammar is not None
    gemma.abort(seq.request_id)
    assert seq.grammar is None and not gemma.has_unfinished()


def test_logprobs_are_those_of_the_masked_logits(gemma):
    # "a" and "b" are pieces and byte tokens (<0x61>, <0x62>): 4 allowed tokens, ranked first.
    seq, = run(gemma, [PROMPT], seeded(1, regex="[ab]", logprobs=6))
    tok = gemma.plan.tokenizer
    first = seq.logprobs[0]
    allowed = {t: lp for t, lp in first.items() if lp > float("-inf")}
    assert {tok.token_to_bytes(t) for t in allowed} == {b"a", b"b"} and len(first) - len(allowed) >= 2
    assert sum(torch.tensor(list(allowed.values())).exp().tolist()) == pytest.approx(1.0, abs=1e-5)


def test_logit_bias_forces_and_bans(qwen):
    prompt = [5, 6, 7, 8]
    plain, = run(qwen, [prompt], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    banned = plain.output_token_ids[0]
    forced, without = run(qwen, [prompt, prompt], [
        SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logit_bias={42: 100}),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={str(banned): -100}),
    ])
    assert forced.output_token_ids == [42] * 6
    assert banned not in without.output_token_ids


def test_logit_bias_outside_the_vocabulary_is_a_request_error(qwen):
    vocab = qwen.plan.model_config.vocab_size
    with pytest.raises(RequestError) as err:
        qwen.add_request([5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias" and str(vocab) in str(err.value)
    assert not qwen.has_unfinished()


def test_llm_generate_takes_constraints(gemma_path):
    from app.engine.api.llm import LLM

    llm = LLM(str(gemma_path), device="cpu", dtype="float32", kv_cache_blocks=128 * GROUPS)
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=20, regex="[0-9]{4}", seed=1),
                                           SamplingParams(max_tokens=5, temperature=0.0)])
    assert re.fullmatch("[0-9]{4}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason in ("stop", "length")


def test_unconstrained_runs_do_not_import_xgrammar(gemma_path):
    code = (
        "import sys\n"
        "from app.engine.api.llm import LLM\n"
        "from app.engine.types.sampling_params import SamplingParams\n"
        f"LLM({str(gemma_path)!r}, device='cpu', kv_cache_blocks=64).generate('hi', SamplingParams(max_tokens=2))\n"
        "assert 'xgrammar' not in sys.modules, 'xgrammar was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- real weights ---


def _smollm2_path():
    from app.engine.gguf.catalog import installed_path

    path = installed_path("smollm2-135m-instruct")
    if path is None:
        pytest.skip("SmolLM2 is not pulled: run `localbatch pull smollm2-135m-instruct` (the README's test command does)")
    return path


@pytest.mark.slow
def test_real_model_json_follows_the_schema_at_temperature(monkeypatch: pytest.MonkeyPatch):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    }
    # bfloat16, not auto: auto's start-up probe would cost more than the test. The packed kernels at
    # every row count: seeded samples must not depend on the crossovers this machine measured.
    from app.engine.runtime import kernel_choice

    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "packed")
    engine = LLMEngine(str(_smollm2_path()), device="cpu", dtype="bfloat16", kv_cache_blocks=64)
    chat = [{"role": "user", "content": "A web site user as JSON: name, age, role and tags."}]
    seqs = run(engine, [chat] * 3, seeded(3, json_schema=schema, max_tokens=60))
    for seq in seqs:
        assert seq.finish_reason == "stop", text(engine, seq)
        assert seq.output_token_ids[-1] in engine.plan.tokenizer.stop_token_ids
        jsonschema.validate(json.loads(text(engine, seq)), schema)
