"""Merge rules that make Hugging Face's BPE tokenize a SentencePiece vocabulary like llama.cpp,
and the on-disk cache that keeps them.

llama.cpp's SentencePiece ("llama") tokenizer is BPE in disguise: it keeps merging the adjacent
pair of symbols whose concatenation is the vocabulary piece with the highest score (leftmost first
on ties). HF's BPE, given one merge rule per (left, right) split of every piece ranked by the
merged piece's score, performs the same merges. Deriving the merges of a large vocabulary is slow
in Python, so they are cached under a hash of the vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from app.engine.text.error_text import one_line
from app.engine.text.vocab import utf8

logger = logging.getLogger(__name__)

# Bump when the merge derivation changes, so that old cache files are not reused.
_MERGES_CACHE_VERSION = 2


def cache_file(cache_dir: Path, tokens: Sequence[str], scores: np.ndarray) -> Path:
    """Where the merges of this vocabulary are cached: one file per vocabulary and version."""
    return cache_dir / f"spm-merges-{_vocab_digest(tokens, scores)}.npz"


def merge_pairs(tokens: Sequence[str], scores: np.ndarray, vocab: Mapping[str, int],
                cache_path: Path | None) -> np.ndarray:
    """[n, 2] ids of (left, right) merges, best first: read from `cache_path` when it holds a
    sound copy, else derived and (when `cache_path` is given) written there."""
    pairs = _load_cached_pairs(cache_path, len(tokens)) if cache_path is not None else None
    if pairs is not None:
        return pairs
    pairs = derive_merge_pairs(tokens, scores, vocab)
    if cache_path is not None:
        _store_cached_pairs(cache_path, pairs)
    return pairs


def derive_merge_pairs(tokens: Sequence[str], scores: np.ndarray, vocab: Mapping[str, int]) -> np.ndarray:
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
    h.update(utf8("\x00".join(tokens)))
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
        logger.warning("tokenizer cache %s is unreadable (%s): rebuilding it", path, one_line(e))
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
