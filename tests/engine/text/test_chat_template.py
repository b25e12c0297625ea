"""Chat templates: the shipped fallbacks, templates from the file, the Jinja2 sandbox, encode_chat."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest

from app.engine.gguf.reader import GGUFFile
from app.engine.text.chat_template import CHAT_TEMPLATE_DIR
from app.engine.text.tokenizer import Tokenizer
from app.engine.text.vocab import TokenType
from app.engine.types.errors import RequestError
from tests.support.oracle import ORACLE_DIR, needs_oracle

ORACLE = ORACLE_DIR / "gemma3_270m.json"

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def metadata(specials: list[str], arch: str, *, bos: int, eos: int, template: str | None = None) -> dict:
    """A small SentencePiece vocab: the given control tokens, byte tokens, a few pieces."""
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["\n"]
    types = ([TokenType.CONTROL] * len(specials) + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
             + [TokenType.USER_DEFINED])
    md = {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": -np.arange(len(tokens), dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray(types, np.int32),
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    if template is not None:
        md["tokenizer.chat_template"] = template
    return md


def gemma(template: str | None = None) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata(GEMMA_SPECIALS, "gemma3", bos=2, eos=1, template=template),
                                        cache_dir=None)


def user(text):
    return {"role": "user", "content": text}


# ----------------------------------------------------------------------------------------------
# Shipped templates
# ----------------------------------------------------------------------------------------------

def test_gemma3_turns():
    tok = gemma()
    assert tok.chat_template_name == "gemma3"
    assert tok.apply_chat_template([user("Hi")]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    convo = [user(" Hi "), {"role": "assistant", "content": "Hello!"}, user("Bye")]
    assert tok.apply_chat_template(convo, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n")


def test_gemma3_folds_system_prompt_into_first_user_turn():
    tok = gemma()
    convo = [{"role": "system", "content": "Be brief."}, user("Hi"), {"role": "assistant", "content": "Yo"},
             user("Again")]
    assert tok.apply_chat_template(convo) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
        "<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n")
    # A system prompt alone still reaches the model.
    assert tok.apply_chat_template([{"role": "system", "content": "Be brief."}]) == (
        "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n")


def test_content_parts_and_missing_content():
    tok = gemma()
    parts = [{"type": "text", "text": "Look "}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "here"}]
    assert tok.apply_chat_template([user(parts)]) == (
        "<bos><start_of_turn>user\nLook here<end_of_turn>\n<start_of_turn>model\n")
    assert tok.apply_chat_template([{"role": "assistant", "content": None}], add_generation_prompt=False) == (
        "<bos><start_of_turn>model\n<end_of_turn>\n")


def test_llama3_and_chatml_fallbacks():
    llama3 = Tokenizer.from_gguf_metadata(metadata(LLAMA3_SPECIALS, "llama", bos=0, eos=4), cache_dir=None)
    assert llama3.chat_template_name == "llama3"
    convo = [{"role": "system", "content": "S"}, user("Hi ")]
    assert llama3.apply_chat_template(convo) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert llama3.stop_token_ids == {1, 4}  # <|end_of_text|> and <|eot_id|>
    chatml = Tokenizer.from_gguf_metadata(metadata(CHATML_SPECIALS, "qwen3", bos=0, eos=2), cache_dir=None)
    assert chatml.chat_template_name == "chatml"
    assert chatml.apply_chat_template(convo) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n")
    # No known markers: Gemma-family architectures still get Gemma's format, others ChatML.
    plain = metadata(["<unk>", "<s>", "</s>"], "llama", bos=1, eos=2)
    assert Tokenizer.from_gguf_metadata(plain, cache_dir=None).chat_template_name == "chatml"
    plain["general.architecture"] = "gemma2"
    assert Tokenizer.from_gguf_metadata(plain, cache_dir=None).chat_template_name == "gemma3"


def test_shipped_templates_exist():
    assert {p.stem for p in CHAT_TEMPLATE_DIR.glob("*.jinja")} >= {"gemma3", "llama3", "chatml"}


def test_encode_chat_has_exactly_one_bos():
    tok = gemma()
    ids = tok.encode_chat([user("Hi")])
    assert ids[0] == 2 and ids[1] == 4 and ids.count(2) == 1
    # encode() keeps llama.cpp's behaviour: a template's <bos> text plus add_bos gives two.
    assert tok.encode(tok.apply_chat_template([user("Hi")]))[:2] == [2, 2]
    # A template that writes no BOS still gets one.
    no_bos = gemma("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert no_bos.encode_chat([user("hi")])[0] == 2


# ----------------------------------------------------------------------------------------------
# Templates from the file and the sandbox
# ----------------------------------------------------------------------------------------------

def test_file_template_takes_precedence_with_hf_helpers():
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
                "{{ eos_token }}{% if add_generation_prompt %}{{ strftime_now('%Y') }}{% endif %}")
    tok = gemma(template)
    assert tok.chat_template_name == "gguf"
    year = datetime.datetime.now().strftime("%Y")
    assert tok.apply_chat_template([user("<b> é")]) == f'[user]"<b> é"<eos>{year}'
    assert tok.apply_chat_template([user({"k": [1, 2]})], add_generation_prompt=False) == (
        '[user]{"k": [1, 2]}<eos>')


def test_trim_and_lstrip_blocks_like_hf():
    tok = gemma("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert tok.apply_chat_template([user("a"), user("b")]) == "a\nb\n"


def test_loopcontrols_and_namespace():
    tok = gemma("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
                "{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")
    assert tok.apply_chat_template([user("a")] * 5) == "2"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ raise_exception.__globals__ }}",
    "{% for i in range(10**9) %}{% endfor %}",
])
def test_sandbox_blocks_escapes(template):
    with pytest.raises(RequestError) as e:
        gemma(template).apply_chat_template([user("hi")])
    assert "\n" not in str(e.value) and e.value.param == "messages"


def test_template_errors_are_request_errors():
    with pytest.raises(RequestError, match="roles must alternate"):
        gemma("{{ raise_exception('roles must alternate') }}").apply_chat_template([user("hi")])
    with pytest.raises(RequestError, match="invalid"):
        gemma("{% for m in messages %}").apply_chat_template([user("hi")])
    with pytest.raises(RequestError, match="TypeError"):
        gemma("{{ messages[0].content + 1 }}").apply_chat_template([user("hi")])


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "no role"}], [["user", "hi"]], None])
def test_invalid_messages(messages):
    with pytest.raises(RequestError) as e:
        gemma().apply_chat_template(messages)
    assert e.value.param == "messages"


# ----------------------------------------------------------------------------------------------
# The embedded model
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@needs_oracle
def test_gemma_encode_chat_matches_oracle(embedded_model_path, tmp_path):
    tok = Tokenizer.from_gguf_metadata(GGUFFile(embedded_model_path).metadata, cache_dir=tmp_path)
    case = next(c for c in json.loads(ORACLE.read_text())["tokenize"] if c["text"].startswith("<start_of_turn>"))
    assert tok.encode_chat([user("What is 2+2?")]) == case["ids"]


def test_tools_reach_templates_that_render_them():
    """OpenAI function definitions go into the template's `tools` (Qwen and Hermes templates list
    them in the system turn); a template that ignores them renders as without."""
    from app.engine.text.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", "gguf")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, True, {}, tools) == "<tools>get_weather;</tools>[user]hi"
    assert template.render(messages, True, {}) == "[user]hi"
