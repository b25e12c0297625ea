"""The fill-in-the-middle tokens of a code model, shared by the tokenizer (which finds them) and
the server (which builds `/infill` and `suffix` prompts from them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimTokens:
    """Token ids of llama.cpp's FIM_PRE, FIM_SUF, FIM_MID and the optional FIM_PAD, FIM_REP
    (repository name, Qwen's `<|repo_name|>`) and FIM_SEP (file separator, `<|file_sep|>`)."""

    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None

    @property
    def end_ids(self) -> list[int]:
        """Ids that end a completion besides EOS: llama.cpp counts FIM_PAD, FIM_REP and FIM_SEP as
        end of generation (a model that writes one has finished the middle and moves on)."""
        return [t for t in (self.pad, self.repo, self.sep) if t is not None]
