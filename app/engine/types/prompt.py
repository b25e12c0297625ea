"""What a request asks the engine to continue."""

from __future__ import annotations

from typing import Any

# A prompt: raw text (no chat template), token ids, or chat messages
# ([{"role": "system"|"user"|"assistant", "content": str}, ...]; the chat template is applied).
Prompt = str | list[int] | list[dict[str, Any]]
