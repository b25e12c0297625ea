"""The GGUF tokenizer: llama.cpp-exact encode and decode, built from a GGUF file's metadata.

Why this design. Encoding runs on Hugging Face `tokenizers`' Rust BPE: for SentencePiece
("llama") vocabularies with merges derived from the scores (see `spm_merges`), plus byte fallback;
byte-level BPE ("gpt2") files carry their own merges, and the pre-tokenizer regexes are
llama.cpp's, chosen by `tokenizer.ggml.pre`. It matches llama.cpp on the oracle and a plain-Python
transliteration of llama.cpp's algorithm in the tests, and encodes an order of magnitude faster
than that transliteration. Special tokens written in the text are cut out first
(`special_tokens`). Decoding bypasses HF and joins per-token byte pieces (`vocab`), so incremental
detokenization (`detokenizer`) is exact. The price is construction: even with cached merges,
building a large vocabulary still takes a noticeable while, mostly HF building its BPE.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import platformdirs
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.engine.text.chat_template import ChatTemplate
from app.engine.text.fim import find_fim_tokens
from app.engine.text.special_tokens import SpecialSplitter
from app.engine.text.spm_merges import cache_file, merge_pairs
from app.engine.text.vocab import TokenType, build_pieces, utf8
from app.engine.types.errors import GGUFError, RequestError
from app.engine.types.fim import FimTokens

logger = logging.getLogger(__name__)

# Small vocabularies build in milliseconds; caching their merges would only litter the cache directory.
_MIN_VOCAB_TO_CACHE = 32768

# Pre-tokenizer splits for byte-level BPE, by `tokenizer.ggml.pre` (llama.cpp's regexes). Each
# entry is applied in turn, every match and every gap between matches becoming its own word.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_PRE_TOKENIZERS = MappingProxyType({
    "default": _DEFAULT_SPLITS,
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    # Every digit its own pre-token, then GPT-2's split (SmolLM2, StarCoder and kin).
    **{pre: (r"\p{N}", _GPT2_SPLIT) for pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
})
# Llama 3 emits a whole pre-token as one id when it is in the vocabulary, before any merge.
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})

# Control tokens that end a turn even when the file does not name them eot/eom (llama.cpp's
# end-of-generation heuristic).
_END_OF_GENERATION_TEXTS = frozenset({
    "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
})

_SURROGATE = re.compile("[\ud800-\udfff]")


def _token_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_vocab:
        logger.warning("ignoring tokenizer.ggml.%s = %d: outside the %d-token vocabulary", key, value, n_vocab)
        return None
    return value


@functools.cache
def _warn_unknown_pre(pre: str) -> None:
    # functools.cache makes this a one-time warning per pre-tokenizer name.
    logger.warning("unknown tokenizer.ggml.pre %r: using llama.cpp's default BPE pre-tokenizer", pre)


# ----------------------------------------------------------------------------------------------
# Backends: HF BPE models
# ----------------------------------------------------------------------------------------------

def _hf_vocab(id_of: dict[str, int]) -> dict[str, int]:
    # Texts holding surrogate escapes cannot cross into Rust and cannot match valid text anyway.
    if _SURROGATE.search("".join(id_of)):
        return {t: i for t, i in id_of.items() if not _SURROGATE.search(t)}
    return id_of


def _spm_backend(tokens: Sequence[str], id_of: dict[str, int], scores: np.ndarray, unk: str | None,
                 cache_dir: Path | None) -> HFTokenizer:
    vocab = _hf_vocab(id_of)
    path = None
    if cache_dir is not None and len(tokens) >= _MIN_VOCAB_TO_CACHE:
        path = cache_file(cache_dir, tokens, scores)
    return _spm_hf_model(tokens, merge_pairs(tokens, scores, vocab, path), vocab, unk)


def _spm_hf_model(tokens: Sequence[str], pairs: np.ndarray, vocab: dict[str, int],
                  unk: str | None) -> HFTokenizer:
    texts = np.array(tokens, dtype=object)
    merges = list(zip(texts[pairs[:, 0]].tolist(), texts[pairs[:, 1]].tolist()))
    unk = unk if unk in vocab else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=False)
    return HFTokenizer(bpe)


def _bpe_backend(id_of: dict[str, int], merges: Sequence[str], pre: str) -> HFTokenizer:
    vocab = _hf_vocab(id_of)
    pairs = []
    for line in merges:
        a, sep, b = line.partition(" ")
        # HF needs both halves and the result in the vocabulary; llama.cpp never emits a merge
        # result outside it either, so such rules can be dropped.
        if sep and a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
    if pre not in _PRE_TOKENIZERS:
        _warn_unknown_pre(pre)
    splits = _PRE_TOKENIZERS.get(pre, _DEFAULT_SPLITS)
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES_PRE)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tok


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

class Tokenizer:
    """A GGUF model's tokenizer: llama.cpp-exact `encode`, `decode`, and its chat template.

    Build it with `Tokenizer.from_gguf_metadata(metadata)`. `cache_dir` keeps the merges derived
    for large SentencePiece vocabularies: True (default) the user cache dir, a path that
    directory, None or False no cache. A damaged cache file is rebuilt; an unwritable one is skipped.
    """

    def __init__(self, metadata: Mapping[str, Any], *, cache_dir: Path | str | None | bool = True) -> None:
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model not in ("llama", "gpt2"):
            raise GGUFError(f"unsupported tokenizer.ggml.model {model!r}: only 'llama' (SentencePiece) "
                            "and 'gpt2' (byte-level BPE) vocabularies are supported")
        if tokens is None or len(tokens) == 0:
            raise GGUFError("the model file has no tokenizer.ggml.tokens: it cannot tokenize text")
        self.model: str = model
        self.architecture: str = str(metadata.get("general.architecture", ""))
        self._tokens: list[str] = list(tokens)
        n = len(self._tokens)
        # Duplicate texts map to the last id, as in llama.cpp's token_to_id.
        self._id_of: dict[str, int] = dict(zip(self._tokens, range(n)))
        types = metadata.get("tokenizer.ggml.token_type")
        self._types = np.full(n, TokenType.NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
        if len(self._types) != n:
            raise GGUFError(f"tokenizer.ggml.token_type has {len(self._types)} entries for {n} tokens")
        self._init_special_ids(metadata, n)
        #: Fill-in-the-middle tokens (code models); None: the model cannot infill.
        self.fim_tokens: FimTokens | None = find_fim_tokens(metadata, self._id_of.get, n)
        self._init_backend(metadata, cache_dir)
        self._pieces = build_pieces(self._tokens, self._types, byte_level=(model == "gpt2"))
        hidden = (self._types == TokenType.CONTROL) | (self._types == TokenType.UNKNOWN)
        self._pieces_skip = [b"" if h else p for p, h in zip(self._pieces, hidden.tolist())]
        self._special_ids = frozenset(np.nonzero(hidden)[0].tolist())
        self._init_special_matching()
        self._chat = ChatTemplate.for_model(metadata, self.architecture, self._id_of)

    @property
    def tokens(self) -> list[str]:
        """Each token id's text, as the GGUF file lists them."""
        return self._tokens

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *,
                           cache_dir: Path | str | None | bool = True) -> Tokenizer:
        """The tokenizer described by a GGUF file's `tokenizer.*` metadata (GGUFFile.metadata)."""
        return cls(metadata, cache_dir=cache_dir)

    # -- construction ------------------------------------------------------------------------

    def _init_special_ids(self, metadata: Mapping[str, Any], n: int) -> None:
        self.bos_token_id: int | None = _token_id(metadata, "bos_token_id", n)
        self.eos_token_id: int | None = _token_id(metadata, "eos_token_id", n)
        self.eot_token_id: int | None = _token_id(metadata, "eot_token_id", n)
        self.eom_token_id: int | None = _token_id(metadata, "eom_token_id", n)
        self.pad_token_id: int | None = _token_id(metadata, "padding_token_id", n)
        self.unk_token_id: int | None = _token_id(metadata, "unknown_token_id", n)
        spm = self.model == "llama"
        # llama.cpp's defaults when a key is absent: SPM adds BOS and a space prefix, BPE neither
        # (except Llama 3's pre-tokenizer, which adds BOS).
        pre = str(metadata.get("tokenizer.ggml.pre") or "default")
        self.pre: str = pre
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", spm or pre in _IGNORE_MERGES_PRE))
        self.add_space_prefix: bool = spm and bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        stop = {i for i in (self.eos_token_id, self.eot_token_id, self.eom_token_id) if i is not None}
        for text in _END_OF_GENERATION_TEXTS:
            i = self._id_of.get(text)
            if i is not None and self._types[i] == TokenType.CONTROL:
                stop.add(i)
        #: Ids that end generation: eos, eot, eom and the model's end-of-turn control tokens.
        self.stop_token_ids: frozenset[int] = frozenset(stop)

    def _init_backend(self, metadata: Mapping[str, Any], cache_dir: Path | str | None | bool) -> None:
        if self.model == "gpt2":
            merges = metadata.get("tokenizer.ggml.merges")
            if merges is None:
                raise GGUFError("byte-level BPE tokenizer without tokenizer.ggml.merges")
            self._backend = _bpe_backend(self._id_of, list(merges), self.pre)
            return
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError("SentencePiece tokenizer without tokenizer.ggml.scores")
        scores = np.asarray(scores, np.float32)
        if len(scores) != len(self._tokens):
            raise GGUFError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(self._tokens)} tokens")
        if cache_dir is True:
            cache_dir = Path(platformdirs.user_cache_dir("localbatch")) / "tokenizer"
        elif cache_dir is False:
            cache_dir = None
        unk = self._tokens[self.unk_token_id] if self.unk_token_id is not None else None
        self._backend = _spm_backend(self._tokens, self._id_of, scores, unk, Path(cache_dir) if cache_dir else None)

    def _init_special_matching(self) -> None:
        # llama.cpp splits special tokens out of the text longest first; user-defined tokens are
        # always split out, control and unknown tokens only when parsing special tokens.
        kinds = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
        ids = np.nonzero(np.isin(self._types, kinds))[0].tolist()
        special = [(i, self._tokens[i]) for i in ids if self._tokens[i]]
        special.sort(key=lambda it: (-len(utf8(it[1])), it[0]))
        self._split_all = SpecialSplitter(special)
        self._split_user = SpecialSplitter([(i, t) for i, t in special if self._types[i] == TokenType.USER_DEFINED])

    # -- vocabulary --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's vocabulary text (SPM pieces keep their `▁`, byte-level BPE its `Ġ`...)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocabulary text is exactly `text`, or None."""
        return self._id_of.get(text)

    def token_type(self, token_id: int) -> TokenType:
        self._check_id(token_id)
        return TokenType(int(self._types[token_id]))

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: what `skip_special_tokens` drops."""
        return token_id in self._special_ids

    def token_to_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes this token adds to decoded text (may be part of a UTF-8 character)."""
        self._check_id(token_id)
        return (self._pieces_skip if skip_special_tokens else self._pieces)[token_id]

    def token_to_piece(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """`token_to_bytes` as text; a lone part of a UTF-8 character shows as U+FFFD."""
        return self.token_to_bytes(token_id, skip_special_tokens).decode("utf-8", "replace")

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise RequestError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")

    # -- encode ------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special=add_bos,
        parse_special)`: BOS first when `add_bos` and the model asks for it; special tokens
        written in the text (`<start_of_turn>`, `<|im_start|>`...) become single ids.
        The file's add_eos_token is not honoured: an EOS at the end of a prompt would end generation."""
        if not isinstance(text, str):
            raise RequestError(f"text to tokenize must be a string, not {type(text).__name__}", param="prompt")
        ids: list[int] = []
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        prev_special = True  # llama.cpp: the space prefix also goes after every special token
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            ids.extend(self._encode_fragment(fragment, prev_special))
            prev_special = False
        return ids

    def _encode_fragment(self, text: str, prev_special: bool) -> list[int]:
        if self.model == "llama":
            if self.add_space_prefix and prev_special:
                text = " " + text
            text = text.replace(" ", "\u2581")
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:  # HF refuses strings that are not valid Unicode
            raise RequestError("text contains invalid Unicode (a lone surrogate)", param="prompt") from None

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        return (self._split_all if parse_special else self._split_user).split(text)

    # -- decode ------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`: the concatenation of the tokens' pieces, decoded as UTF-8 (invalid bytes
        become U+FFFD). `skip_special_tokens` drops control and unknown tokens. With a space
        prefix (Llama 2 style SPM) the first token's leading space is removed, as llama.cpp does."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self._tokens)):
            bad = next(i for i in ids if not 0 <= i < len(self._tokens))
            self._check_id(bad)
        pieces = self._pieces_skip if skip_special_tokens else self._pieces
        data = b"".join([pieces[i] for i in ids])
        first = self._first_piece_index(ids, skip_special_tokens)
        if first is not None and pieces[ids[first]].startswith(b" "):
            data = data[1:]  # every piece before `first` is empty
        return data.decode("utf-8", "replace")

    def _first_piece_index(self, ids: Sequence[int], skip_special_tokens: bool) -> int | None:
        """Index of the token whose leading space llama.cpp strips, or None when none is."""
        if not self.add_space_prefix or not ids:
            return None
        if skip_special_tokens and self.add_bos and ids[0] == self.bos_token_id:
            return 1 if len(ids) > 1 else None
        return 0

    # -- chat --------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str:
        """The Jinja2 source in use: the file's, else the shipped fallback's."""
        return self._chat.source

    @property
    def chat_template_name(self) -> str:
        """"gguf" for the file's own template, else the shipped fallback's name."""
        return self._chat.name

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render the conversation (and `tools`, for templates that take them) with the model's
        chat template (the file's, else the one shipped for its architecture) in a sandboxed
        Jinja2 environment."""
        special_tokens: dict[str, str] = {}
        for name in ("bos", "eos", "unk", "pad"):
            token_id = getattr(self, f"{name}_token_id")
            special_tokens[f"{name}_token"] = self._tokens[token_id] if token_id is not None else ""
        return self._chat.render(messages, add_generation_prompt, special_tokens, tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS whether or not the
        template writes it."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids
