"""Tokenizer, incremental detokenizer and chat templates, all built from a GGUF file's metadata.

Why this design. llama.cpp's SentencePiece ("llama") tokenizer is BPE in disguise: it keeps
merging the adjacent pair of symbols whose concatenation is the vocabulary piece with the highest
score (leftmost first on ties) and spells characters that are no piece as `<0xXX>` byte tokens.
Hugging Face `tokenizers`' Rust BPE, given one merge rule per (left, right) split of every piece
ranked by the merged piece's score, plus byte fallback, performs the same merges: it matches
llama.cpp on the oracle and a plain-Python transliteration of llama.cpp's algorithm in the tests,
and encodes 100 KB in ~30 ms of CPU where that transliteration needs ~0.5 s. Byte-level BPE
("gpt2") files carry their own merges; the pre-tokenizer regexes are llama.cpp's, chosen by
`tokenizer.ggml.pre`. Special tokens written in the text are cut out in Python first, in
llama.cpp's order (longest first), because HF's added-token matcher is leftmost-longest and can
disagree. Decoding bypasses HF: it joins per-token byte pieces exactly as llama.cpp's
`token_to_piece` writes them, so incremental detokenization is exact and O(1) per token with an
incremental UTF-8 decoder, without a re-decoding window. The price is construction: deriving the
~515k merges of a 262k vocabulary takes ~1 s of Python, so they are cached under a hash of the
vocabulary; a cached build still takes ~1 s, mostly HF building its BPE.
"""

from __future__ import annotations

import codecs
import datetime
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import platformdirs
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app import ASSETS_DIR
from app.engine.api.errors import GGUFError, RequestError

logger = logging.getLogger(__name__)

CHAT_TEMPLATE_DIR = ASSETS_DIR / "chat_templates"

# Bump when the merge derivation changes, so that old cache files are not reused.
_MERGES_CACHE_VERSION = 2
# Small vocabularies build in milliseconds; caching them would only litter the cache directory.
_MIN_VOCAB_TO_CACHE = 32768


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


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


# ----------------------------------------------------------------------------------------------
# Vocabulary helpers
# ----------------------------------------------------------------------------------------------

def _gpt2_byte_chars() -> list[str]:
    """Byte -> character table of byte-level BPE: printable Latin-1 bytes stand for themselves,
    the rest are moved to U+0100.. so that every token text is printable."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, moved = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + moved))
            moved += 1
    return chars


def _utf8(text: str) -> bytes:
    # Token texts that were not valid UTF-8 in the file come back as surrogate escapes.
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _byte_piece(text: str) -> bytes:
    # `<0xXX>`; anything else marked BYTE is rendered as its text.
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return _utf8(text)


def _spm_normal_pieces(tokens: Sequence[str]) -> list[bytes]:
    """Every token read as an SPM piece (`▁` is a space); one join/split instead of 262k calls."""
    joined = "\x00".join(tokens).replace("\u2581", " ")
    try:
        pieces = joined.encode("utf-8", "surrogateescape").split(b"\x00")
    except UnicodeEncodeError:
        pieces = []
    if len(pieces) != len(tokens):  # a token holds NUL or an unencodable character
        pieces = [_utf8(t.replace("\u2581", " ")) for t in tokens]
    return pieces


def _bpe_normal_pieces(tokens: Sequence[str]) -> list[bytes]:
    """Every token read as byte-level BPE text: each character stands for one byte."""
    chars = _gpt2_byte_chars()
    byte_of = {c: b for b, c in enumerate(chars)}
    if set("".join(tokens)) <= byte_of.keys():
        table = str.maketrans({c: chr(b) for b, c in enumerate(chars)})
        return [t.translate(table).encode("latin-1") for t in tokens]
    # Some text is not byte-level (added tokens): keep such characters as UTF-8.
    return [b"".join(bytes([byte_of[c]]) if c in byte_of else _utf8(c) for c in t) for t in tokens]


def _build_pieces(tokens: Sequence[str], types: np.ndarray, byte_level: bool) -> list[bytes]:
    """What each token decodes to (llama.cpp token_to_piece with special=True)."""
    pieces = _bpe_normal_pieces(tokens) if byte_level else _spm_normal_pieces(tokens)
    others = np.nonzero((types != TokenType.NORMAL) & (types != TokenType.UNDEFINED))[0]
    for i, kind in zip(others.tolist(), types[others].tolist()):
        if kind == TokenType.BYTE:
            pieces[i] = _byte_piece(tokens[i])
        elif kind == TokenType.UNUSED:
            pieces[i] = b""
        else:  # control, unknown and user-defined tokens are written as their text
            pieces[i] = _utf8(tokens[i])
    return pieces


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


def _spm_merge_pairs(tokens: Sequence[str], scores: np.ndarray, vocab: Mapping[str, int]) -> np.ndarray:
    """[n, 2] ids of (left, right) for every split of every piece into two pieces, ordered by
    the score of the merged piece, highest first.

    HF ranks merges one by one, so between two different pieces of exactly equal score the lower
    id merges first where llama.cpp takes the leftmost pair; real SPM vocabularies (Gemma's,
    Llama 2's) give their pieces distinct scores."""
    owner: list[int] = []
    left: list[int] = []
    right: list[int] = []
    get = vocab.get
    for i, text in enumerate(tokens):
        if get(text) != i:  # a duplicate text (llama.cpp keeps the last id) or not in the HF vocab
            continue
        for k in range(1, len(text)):
            a = get(text[:k])
            if a is not None:
                b = get(text[k:])
                if b is not None:
                    owner.append(i)
                    left.append(a)
                    right.append(b)
    ids = np.arange(len(tokens))
    rank_of = np.empty(len(tokens), dtype=np.int64)
    rank_of[np.lexsort((ids, -scores.astype(np.float64)))] = ids
    order = np.argsort(rank_of[np.asarray(owner, dtype=np.int64)], kind="stable")
    return np.stack([np.asarray(left, dtype=np.int32), np.asarray(right, dtype=np.int32)], axis=1)[order]


def _vocab_digest(tokens: Sequence[str], scores: np.ndarray) -> str:
    h = hashlib.sha256(f"v{_MERGES_CACHE_VERSION}:{len(tokens)}:".encode())
    h.update(_utf8("\x00".join(tokens)))
    h.update(np.ascontiguousarray(scores, dtype="<f4").tobytes())
    return h.hexdigest()[:32]


def _pairs_digest(pairs: np.ndarray) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(np.ascontiguousarray(pairs).tobytes()).digest(), np.uint8)


def _load_cached_pairs(path: Path, n_vocab: int) -> np.ndarray | None:
    """The cached merge pairs, or None when the file is missing or damaged in any way."""
    try:
        with np.load(path, allow_pickle=False) as f:
            pairs, digest = f["pairs"], f["digest"]
    except FileNotFoundError:
        return None
    except Exception as e:  # truncated, not a zip, missing arrays...
        logger.warning("tokenizer cache %s is unreadable (%s): rebuilding it", path, _one_line(e))
        return None
    # The checksum matters: HF's BPE panics (not raises) on merges outside the vocabulary.
    if (pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != np.int32
            or not np.array_equal(digest, _pairs_digest(pairs))
            or (pairs.size and (pairs.min() < 0 or pairs.max() >= n_vocab))):
        logger.warning("tokenizer cache %s is damaged: rebuilding it", path)
        return None
    return pairs


def _store_cached_pairs(path: Path, pairs: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, pairs=pairs, digest=_pairs_digest(pairs))
        os.replace(tmp, path)  # atomic: readers never see half a file
    except OSError as e:
        logger.warning("cannot write tokenizer cache %s: %s", path, e)


def _spm_backend(tokens: Sequence[str], id_of: dict[str, int], scores: np.ndarray, unk: str | None,
                 cache_dir: Path | None) -> HFTokenizer:
    vocab = _hf_vocab(id_of)
    path = None
    if cache_dir is not None and len(tokens) >= _MIN_VOCAB_TO_CACHE:
        path = cache_dir / f"spm-merges-{_vocab_digest(tokens, scores)}.npz"
    pairs = _load_cached_pairs(path, len(tokens)) if path is not None else None
    if pairs is not None:
        return _spm_hf_model(tokens, pairs, vocab, unk)
    pairs = _spm_merge_pairs(tokens, scores, vocab)
    if path is not None:
        _store_cached_pairs(path, pairs)
    return _spm_hf_model(tokens, pairs, vocab, unk)


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
# Special tokens written in the text
# ----------------------------------------------------------------------------------------------

def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of `words` that starts at the current position."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Greedy optional tail: a longer word is preferred, a shorter one is the fallback.
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


class _SpecialSplitter:
    """Cuts special tokens out of text exactly as llama.cpp's `tokenizer_st_partition`: each
    token in turn, longest (in UTF-8 bytes) first, is split out of the text that is still raw,
    leftmost occurrences first. That order can differ from a leftmost-longest scan (with tokens
    "ab" and "bcd", "abcd" splits as "a" + "bcd").

    Searching for thousands of tokens (Gemma has 6,414) in long text would be slow, so a trie
    regex over the tokens' first `_PREFIX` characters first finds, at every position, the longest
    such prefix starting there; only tokens whose prefix is a prefix of one of those can occur.
    """

    _PREFIX = 32  # bounds the trie's depth (and the regex's nesting) for very long tokens

    def __init__(self, specials: Sequence[tuple[int, str]]) -> None:
        self._rank: dict[str, tuple[int, int]] = {}  # text -> (order, id); the first id wins
        for order, (token_id, text) in enumerate(specials):
            self._rank.setdefault(text, (order, token_id))
        self._by_prefix: dict[str, list[str]] = {}
        for text in self._rank:
            self._by_prefix.setdefault(text[:self._PREFIX], []).append(text)
        self._regex: re.Pattern[str] | None = None
        self._candidates: dict[str, tuple[str, ...]] = {}

    def split(self, text: str) -> list[str | int]:
        tokens = self._tokens_in(text)
        if not tokens:
            return [text] if text else []
        claimed = bytearray(len(text))
        spans: list[tuple[int, int, int]] = []
        for token in sorted(tokens, key=self._rank.__getitem__):
            self._claim(text, token, claimed, spans)
        spans.sort()
        parts: list[str | int] = []
        pos = 0
        for start, end, token_id in spans:
            if start > pos:
                parts.append(text[pos:start])
            parts.append(token_id)
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _claim(self, text: str, token: str, claimed: bytearray, spans: list[tuple[int, int, int]]) -> None:
        token_id, n = self._rank[token][1], len(token)
        pos = text.find(token)
        while pos != -1:
            hit = claimed.find(1, pos, pos + n)
            if hit == -1:
                spans.append((pos, pos + n, token_id))
                claimed[pos:pos + n] = b"\x01" * n
                pos = text.find(token, pos + n)
                continue
            # Overlaps text already split out: the next chance starts past that stretch.
            free = claimed.find(0, hit)
            pos = -1 if free == -1 else text.find(token, free)

    def _tokens_in(self, text: str) -> set[str]:
        """The special tokens that may occur in `text` (a small superset of those that do)."""
        if not self._rank:
            return set()
        if self._regex is None:
            self._regex = re.compile(f"(?=({_trie_pattern(self._by_prefix)}))")
        found: set[str] = set()
        for longest in set(self._regex.findall(text)):
            found.update(self._starting_with_prefix_of(longest))
        return found

    def _starting_with_prefix_of(self, head: str) -> tuple[str, ...]:
        tokens = self._candidates.get(head)
        if tokens is None:
            tokens = tuple(t for k in range(1, len(head) + 1) for t in self._by_prefix.get(head[:k], ()))
            self._candidates[head] = tokens
        return tokens


# ----------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates want plain JSON (as transformers renders it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Sandboxed and immutable: a chat template comes from the model file, which is untrusted."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja's default renders a blocked attribute as empty; failing loudly is clearer.
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


def _chat_environment() -> _ChatSandbox:
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")


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
        self._init_backend(metadata, cache_dir)
        self._pieces = _build_pieces(self._tokens, self._types, byte_level=(model == "gpt2"))
        hidden = (self._types == TokenType.CONTROL) | (self._types == TokenType.UNKNOWN)
        self._pieces_skip = [b"" if h else p for p, h in zip(self._pieces, hidden.tolist())]
        self._special_ids = frozenset(np.nonzero(hidden)[0].tolist())
        self._init_special_matching()
        self._init_chat_template(metadata)

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
        special.sort(key=lambda it: (-len(_utf8(it[1])), it[0]))
        self._split_all = _SpecialSplitter(special)
        self._split_user = _SpecialSplitter([(i, t) for i, t in special if self._types[i] == TokenType.USER_DEFINED])

    def _init_chat_template(self, metadata: Mapping[str, Any]) -> None:
        template = metadata.get("tokenizer.chat_template")
        if isinstance(template, str) and template.strip():
            self.chat_template: str = template
            self.chat_template_name: str = "gguf"
        else:
            self.chat_template_name = self._fallback_template_name()
            self.chat_template = (CHAT_TEMPLATE_DIR / f"{self.chat_template_name}.jinja").read_text("utf-8")
        self._compiled_template: jinja2.Template | None = None

    def _fallback_template_name(self) -> str:
        for marker, name in (("<start_of_turn>", "gemma3"), ("<|start_header_id|>", "llama3"),
                             ("<|im_start|>", "chatml")):
            if self.token_to_id(marker) is not None:
                return name
        return "gemma3" if self.architecture.startswith("gemma") else "chatml"

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

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render the conversation with the model's chat template (the file's, else the one
        shipped for its architecture) in a sandboxed Jinja2 environment."""
        _check_messages(messages)
        template = self._template()
        context: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        for name in ("bos", "eos", "unk", "pad"):
            token_id = getattr(self, f"{name}_token_id")
            context[f"{name}_token"] = self._tokens[token_id] if token_id is not None else ""
        try:
            return template.render(context)
        except RequestError:
            raise
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template error: {_one_line(e)}", param="messages") from None
        except Exception as e:  # TypeError, KeyError ... raised by a template's own operations
            raise RequestError(f"chat template failed: {type(e).__name__}: {_one_line(e)}",
                               param="messages") from None

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            try:
                self._compiled_template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise RequestError(f"the model's chat template is invalid: {_one_line(e)} (line {e.lineno})",
                                   param="messages") from None
        return self._compiled_template

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS whether or not the
        template writes it."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)
        bos = self.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids


class IncrementalDetokenizer:
    """Streaming decode of generated ids: `add()` returns only the text completed by the new ids.

    Pieces are bytes, so the state is just an incremental UTF-8 decoder holding at most the
    first 3 bytes of a character whose byte-fallback tokens have not all arrived: O(1) per token.
    The concatenation of every `add()` result and a final `flush()` equals `decode(output_ids)`
    (without `prompt_ids`), or the text that `output_ids` add to `decode(prompt_ids)` (with them:
    the first output token is not at the start of the text, so its leading space is kept).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._num_tokens = 0
        # llama.cpp strips one leading space off the first token of a text (SPM space prefix).
        self._strip_space = tokenizer.add_space_prefix and not prompt_ids

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, token_ids: Iterable[int]) -> str:
        """Text completed by `token_ids`; a partial UTF-8 character waits for its next bytes."""
        tok = self.tokenizer
        parts = []
        for token_id in token_ids:
            piece = tok.token_to_bytes(token_id, self.skip_special_tokens)
            if self._strip_space:
                piece = self._strip_first(token_id, piece)
            self._num_tokens += 1
            if piece:
                parts.append(piece)
        return self._utf8.decode(b"".join(parts)) if parts else ""

    def _strip_first(self, token_id: int, piece: bytes) -> bytes:
        tok = self.tokenizer
        skipped_bos = (self._num_tokens == 0 and self.skip_special_tokens and tok.add_bos
                       and token_id == tok.bos_token_id)
        if skipped_bos:
            return piece
        self._strip_space = False
        return piece[1:] if piece.startswith(b" ") else piece

    def flush(self) -> str:
        """At the end of the stream: U+FFFD for a UTF-8 character that never completed."""
        return self._utf8.decode(b"", final=True)
