"""The structured-output pieces without a model: constraint keys, the LRU of compiled grammars,
the tokenizer view and the batched mask (including logits wider than the tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine.core.sequence import Sequence
from app.engine.structured.bitmask import GrammarBitmask
from app.engine.structured.cache import LRUCache
from app.engine.structured.compiler import ConstraintCompiler
from app.engine.structured.constraint import Constraint, constraint_of
from app.engine.structured.json_schema import JSON_MAX_WHITESPACE
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf_factory):
    from app.engine.gguf.reader import GGUFFile
    from app.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(GGUFFile(tiny_gguf_factory("gemma3")).metadata, cache_dir=None)


# --- constraint keys ---


def test_constraint_keys_are_canonical():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict = constraint_of(SamplingParams(json_schema=schema))
    as_text = constraint_of(SamplingParams(json_schema=json.dumps(schema, indent=2)))
    assert as_dict == as_text and as_dict.field == "json_schema"
    assert list(json.loads(as_dict.spec)["properties"]) == ["b", "a"]  # property order is kept
    assert constraint_of(SamplingParams(regex="a+")) == Constraint("regex", "a+")
    assert constraint_of(SamplingParams(json_object=True)) == Constraint("json_object", "")
    assert constraint_of(SamplingParams()) is None


def test_legacy_structural_tag_becomes_triggered_tags():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
    spec = json.loads(constraint_of(SamplingParams(structural_tag=legacy)).spec)
    content = {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    assert spec == {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"type": "tag", "begin": "<f=a>", "end": "</f>", "content": content}]}}


def test_structural_tag_json_gets_the_whitespace_cap_unless_it_sets_one():
    content = {"type": "json_schema", "json_schema": {"type": "object"}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
        {"type": "tag", "begin": "<b>", "content": {**content, "max_whitespace_cnt": 2}, "end": "</b>"}]}}
    elements = json.loads(constraint_of(SamplingParams(structural_tag=tag)).spec)["format"]["elements"]
    assert [e["content"]["max_whitespace_cnt"] for e in elements] == [JSON_MAX_WHITESPACE, 2]


def test_bounded_strings_become_patterns_that_exclude_control_characters():
    schema = {"type": "object", "properties": {
        "short": {"type": "string", "maxLength": 5},
        "long": {"type": "string", "minLength": 2},
        "own": {"type": "string", "maxLength": 3, "pattern": "^x+$"},
        "choice": {"enum": [{"type": "string", "maxLength": 3}]}}}
    props = json.loads(constraint_of(SamplingParams(json_schema=schema)).spec)["properties"]
    assert props["short"] == {"type": "string", "pattern": "^.{0,5}$"}
    assert props["long"] == {"type": "string", "pattern": "^.{2,}$"}
    assert props["own"] == schema["properties"]["own"] and props["choice"] == schema["properties"]["choice"]


def test_bounded_string_grammar_rejects_raw_control_characters(tokenizer):
    """xgrammar's own bounded-string rule would take a raw \x05 or tab (its issue #800)."""
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size)
    schema = {"type": "string", "maxLength": 4}
    control = tokenizer.token_to_id("<0x05>")
    grammar = compiler.matcher_for(SamplingParams(json_schema=schema))
    assert grammar.accept(tokenizer.token_to_id("<0x22>"))  # the opening quote
    assert not grammar.accept(control) and not grammar.accept(tokenizer.token_to_id("<0x09>"))
    assert grammar.accept(tokenizer.token_to_id("\u2581the"))


def test_json_spec_that_is_not_an_object_is_rejected():
    for value in ("[1]", "3", "nope"):
        with pytest.raises(RequestError) as err:
            constraint_of(SamplingParams(structural_tag=value))
        assert err.value.param == "structural_tag"


# --- the LRU of compiled grammars ---


def test_lru_forgets_the_least_recently_used_by_weight():
    cache: LRUCache[str, str] = LRUCache(10, weight=len)
    cache.put("a", "xxxx")
    cache.put("b", "xxxx")
    assert cache.get("a") == "xxxx"  # a is now the most recent
    cache.put("c", "xxxx")  # 12 > 10: b goes
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    cache.put("huge", "x" * 50)  # heavier than the capacity: kept alone
    assert len(cache) == 1 and cache.get("huge") and cache.total_weight == 50
    with pytest.raises(ValueError):
        LRUCache(0)


def test_compiled_grammars_are_cached_per_constraint(tokenizer):
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size)
    a = compiler.compile(Constraint("regex", "[ab]+"))
    assert compiler.compile(Constraint("regex", "[ab]+")) is a
    assert compiler.compile(Constraint("regex", "[ab]*")) is not a and compiler.num_cached == 2


# --- the mask ---


def _constrained(compiler: ConstraintCompiler, regex: str) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(regex=regex), 10)
    seq.grammar = compiler.matcher_for(seq.params)
    return seq


def test_mask_covers_logit_columns_past_the_tokenizer(tokenizer):
    """Gemma's logits are wider than its tokenizer: constrained rows must never pick those ids."""
    width = tokenizer.vocab_size + 40
    compiler = ConstraintCompiler(tokenizer, width)
    seqs = [_constrained(compiler, "[ab]"), Sequence("free", [1, 2], SamplingParams(), 10)]
    logits = torch.zeros(2, width)
    logits[:, tokenizer.vocab_size:] = 50.0  # the padding columns would win every draw
    GrammarBitmask(width).apply(logits, seqs)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert {tokenizer.token_to_bytes(t) for t in allowed} == {b"a", b"b"}
    assert torch.equal(logits[1], torch.cat([torch.zeros(tokenizer.vocab_size), torch.full((40,), 50.0)]))


def test_mask_rows_follow_their_own_sequences(tokenizer):
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size)
    seqs = [Sequence("free", [1], SamplingParams(), 10), _constrained(compiler, "a"), _constrained(compiler, "b")]
    logits = torch.zeros(3, tokenizer.vocab_size)
    mask = GrammarBitmask(tokenizer.vocab_size)
    mask.apply(logits, seqs)
    assert torch.isfinite(logits[0]).all()
    assert [tokenizer.token_to_bytes(int(logits[i].argmax())) for i in (1, 2)] == [b"a", b"b"]
    mask.apply(torch.zeros(1, tokenizer.vocab_size), seqs[:1])  # a smaller batch reuses the buffer


# --- real vocabularies: a valid text's own tokens walk through the grammar ---


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _walk(tokenizer, params: SamplingParams, valid: str, vocab_size: int | None = None) -> None:
    width = vocab_size or tokenizer.vocab_size
    grammar = ConstraintCompiler(tokenizer, width).matcher_for(params)
    bitmask = torch.empty(1, -(-width // 32), dtype=torch.int32)
    for token in tokenizer.encode(valid, add_bos=False):
        grammar.fill_bitmask(bitmask, 0)
        assert _allowed(bitmask, token), (valid, tokenizer.token_to_piece(token))
        assert grammar.accept(token)
    grammar.fill_bitmask(bitmask, 0)
    assert all(_allowed(bitmask, t) for t in tokenizer.stop_token_ids)
    assert not any(_allowed(bitmask, t) for t in range(tokenizer.vocab_size, width))
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated


VALID_JSON = '{"name": "Zoë Ångström", "age": 30, "tags": ["a b", "日本"], "note": "tab\\tand \\"quote\\""}'
VALID_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                 "age": {"type": "integer"}, "tags": {"type": "array"},
                                                 "note": {"type": "string"}}}


def _smollm2_tokenizer():
    from app.engine.gguf.catalog import installed_path
    from app.engine.gguf.reader import GGUFFile
    from app.engine.text.tokenizer import Tokenizer

    path = installed_path("smollm2-135m-instruct")
    if path is None:
        pytest.skip("SmolLM2 is not pulled: run `localbatch pull smollm2-135m-instruct` (the README's test command does)")
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


def test_byte_level_bpe_vocabulary_walks_its_own_json():
    tokenizer = _smollm2_tokenizer()
    _walk(tokenizer, SamplingParams(json_schema=VALID_SCHEMA), VALID_JSON)
    _walk(tokenizer, SamplingParams(regex=r"[A-Z][a-z]+ [0-9]{2}"), "Paris 75", vocab_size=tokenizer.vocab_size + 64)


@pytest.mark.slow
def test_sentencepiece_vocabulary_with_wider_logits_walks_its_own_json(embedded_model_path):
    """Gemma 3: 262k SentencePiece pieces with byte fallback, here with 128 logit columns past the
    token list (as models whose logits are wider than their tokenizer have): they stay masked."""
    from app.engine.gguf.reader import GGUFFile
    from app.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(embedded_model_path).metadata)
    _walk(tokenizer, SamplingParams(json_object=True), VALID_JSON, vocab_size=tokenizer.vocab_size + 128)


def test_matchers_can_be_made_from_several_threads_at_once(tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size)
    specs = [SamplingParams(regex=f"[ab]{{{i % 3 + 1}}}") for i in range(12)]
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.matcher_for, specs))
    assert all(g is not None for g in grammars) and compiler.num_cached == 3
