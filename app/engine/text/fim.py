"""Finding a model's fill-in-the-middle tokens, as llama.cpp does: the GGUF's metadata first, then
the texts the known code-model families give them in their vocabularies."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from app.engine.types.fim import FimTokens

logger = logging.getLogger(__name__)

# Per role: the metadata keys (llama.cpp's current name, then its older one) and the known texts
# (Qwen, Granite/StarCoder, DeepSeek-Coder, CodeLlama, GLM-4.5, ...), tried in this order.
_ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prefix": (("fim_pre_token_id", "prefix_token_id"),
               ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>")),
    "suffix": (("fim_suf_token_id", "suffix_token_id"),
               ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>")),
    "middle": (("fim_mid_token_id", "middle_token_id"),
               ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>")),
    "pad": (("fim_pad_token_id",), ("<|fim_pad|>", "<fim-pad>", "<fim_pad>")),
    "repo": (("fim_rep_token_id",), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "sep": (("fim_sep_token_id",), ("<|file_sep|>", "<file_sep>")),
}


def find_fim_tokens(metadata: Mapping[str, Any], token_to_id: Callable[[str], int | None],
                    vocab_size: int) -> FimTokens | None:
    """The model's FIM tokens, or None when prefix, suffix or middle is missing (no infill then).
    `metadata`: the GGUF's key/values (`tokenizer.ggml.fim_pre_token_id`...); `token_to_id`: the
    vocabulary's exact-text lookup."""
    found: dict[str, int | None] = {}
    for role, (keys, texts) in _ROLES.items():
        found[role] = _from_metadata(metadata, keys, vocab_size)
        if found[role] is None:
            found[role] = next((i for i in map(token_to_id, texts) if i is not None), None)
    prefix, suffix, middle = found["prefix"], found["suffix"], found["middle"]
    if prefix is None or suffix is None or middle is None:
        return None
    return FimTokens(prefix, suffix, middle, found["pad"], found["repo"], found["sep"])


def _from_metadata(metadata: Mapping[str, Any], keys: tuple[str, ...], vocab_size: int) -> int | None:
    for key in keys:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
        # -1 (llama.cpp's LLAMA_TOKEN_NULL) or out of range: look the token up by its text instead.
        if value != -1:
            logger.warning("ignoring tokenizer.ggml.%s = %r: not a token id of the %d-token vocabulary",
                           key, value, vocab_size)
    return None
