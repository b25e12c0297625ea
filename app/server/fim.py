"""Fill-in-the-middle prompts (code completion at a cursor), laid out as llama.cpp's `/infill`
lays them out, so that models and editor plugins tuned against llama-server behave the same here.

Qwen2.5-Coder's repository-level layout (arXiv 2409.12186), used when the model has FIM_REP and
FIM_SEP tokens; other models get the extra chunks after a plain-text snippet separator:

    [BOS]  (only when the model's tokenizer adds one)
    <|repo_name|>myproject\\n
    <|file_sep|>{filename}\\n{text}        one per extra chunk
    <|file_sep|>filename\\n
    <|fim_prefix|>{prefix}{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

Why this order suits the prefix cache: an editor sends the same extra chunks (llama.vim's ring
buffer, which it pre-fills with `n_predict: 0`) and nearly the same prefix on every keystroke, so
the engine's paged prefix cache serves the chunks and the prefix up to the edit, and only the
cursor line, the suffix (at most a quarter of the window) and FIM_MID are computed again. Once
the prefix is longer than its budget its front is cut, so each new line moves the cut and the
cache stops after the extra chunks. (llama.cpp puts BOS after the extra chunks; here it stays
first, where the model saw it in training; Qwen adds none.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.engine.api.engine_client import EngineClient
from app.engine.types.context_window import prompt_budget
from app.engine.types.fim import FimTokens
from app.server.http_errors import ApiError

# llama.cpp sizes the prefix and suffix to fit its default batch (n_batch 2048): the prefix takes
# 3/4 of it, the suffix and the typed prompt 1/4.
FIM_WINDOW = 2048
# llama.cpp's stand-ins until clients send them.
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
DEFAULT_CHUNK_NAME = "tmp"
# Between extra chunks when the model has no FIM_SEP token.
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class ExtraChunk:
    """Context from another file (or elsewhere in this one): llama.cpp's `input_extra` item."""

    text: str
    filename: str = DEFAULT_CHUNK_NAME


@dataclass(frozen=True)
class FimPrompt:
    token_ids: list[int]
    truncated: bool  # extra chunks were cut to fit the context (llama.vim warns then)


def require_fim(engine: EngineClient, param: str) -> FimTokens:
    """The model's FIM tokens, or a 400 naming `param` that says what is missing."""
    if engine.fim_tokens is None:
        raise ApiError(400, f"{param}: this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                            "<|fim_middle|> or a family's equivalent); load a code model with FIM support, such as "
                            "Qwen2.5-Coder", param=param)
    return engine.fim_tokens


def window(max_model_len: int) -> int:
    """Tokens for prefix + prompt + suffix: llama.cpp's batch, but at most half the context."""
    return max(8, min(FIM_WINDOW, max_model_len // 2)) if max_model_len > 0 else FIM_WINDOW


def build_fim_prompt(encode: Encode, fim: FimTokens, prefix: str | Sequence[int], suffix: str, *, prompt: str = "",
                     extra: Sequence[ExtraChunk] = (), bos: Sequence[int] = (), max_model_len: int = 0,
                     n_predict: int | None = None, spm_order: bool = False) -> FimPrompt:
    """Token ids of a FIM prompt (see the module docstring). `encode`: text to ids without BOS;
    `prefix` may already be token ids; `prompt`: text after the prefix (llama.vim sends the cursor
    line's start here); `bos`: the ids to start with ([] for models that add no BOS).
    `spm_order` (llama.cpp's --spm-infill): suffix before prefix, for models trained that way.

    Budgets, as llama.cpp's: the prefix keeps its last 3/4 of the window, the suffix its first
    1/4 less the prompt; the extra chunks keep their last tokens that fit in what the context
    leaves after the window and twice the tokens to generate."""
    size = window(max_model_len)
    prefix_ids = encode(prefix) if isinstance(prefix, str) else list(prefix)
    suffix_ids = encode(suffix)
    prompt_ids = encode(prompt) if prompt else []
    prefix_ids = prefix_ids[len(prefix_ids) - min(len(prefix_ids), 3 * (size // 4)):]
    suffix_ids = suffix_ids[:max(0, size // 4 - (2 + len(prompt_ids)))]
    extra_ids = _extra_tokens(encode, fim, extra)
    keep = len(extra_ids)
    if max_model_len > 0:
        # Room to generate: n_predict (at most a quarter of the context), or an eighth of the
        # context when it is unlimited (llama.cpp then leaves almost none); twice that is kept free.
        reserve = min(n_predict, max_model_len // 4) if n_predict and n_predict > 0 else max_model_len // 8
        keep = min(max(0, prompt_budget(max_model_len, 2 * reserve) - size), keep)
    before = [fim.prefix, *prefix_ids, *prompt_ids]
    after = [fim.suffix, *suffix_ids]
    first, second = (after, before) if spm_order else (before, after)
    ids = [*bos, *extra_ids[len(extra_ids) - keep:], *first, *second, fim.middle]
    return FimPrompt(ids, keep < len(extra_ids))


def _extra_tokens(encode: Encode, fim: FimTokens, extra: Sequence[ExtraChunk]) -> list[int]:
    """The repository header, the extra chunks and the current file's header."""
    ids: list[int] = []
    if fim.repo is not None:
        ids += [fim.repo, *encode(REPO_NAME + "\n")]
    for chunk in extra:
        if fim.sep is not None:
            ids += [fim.sep, *encode(chunk.filename + "\n")]
        else:
            ids += encode(CHUNK_SEPARATOR)
        ids += encode(chunk.text)
    if fim.sep is not None:
        ids += [fim.sep, *encode(CURRENT_FILE + "\n")]
    return ids


def engine_encoder(engine: EngineClient) -> tuple[Encode, list[int]]:
    """`encode` without BOS for the parts, and the BOS ids the model's prompts start with (its
    tokenizer adds one or not: an empty text shows which)."""
    # The user's text stays text: a file that contains "<|fim_middle|>" must not steer the prompt.
    return (lambda text: engine.encode(text, add_bos=False, parse_special=False)), engine.encode("", add_bos=True)
