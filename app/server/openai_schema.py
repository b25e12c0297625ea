"""Request bodies of the OpenAI-compatible routes (pydantic models, strict types).

Unknown fields are ignored (OpenAI clients send fields such as `user` that change nothing here);
known fields of the wrong type or out of range are rejected, and so are features this server does
not implement (tools, JSON response formats, logit bias) rather than silently ignoring them.
Range checks that `SamplingParams` already makes are left to it, so the TUI and the HTTP API share
one set of rules and messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
)

from app.engine.api.errors import RequestError
from app.engine.api.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Token ids travel through int32 tensors in the engine.
TOKEN_ID_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
# One HTTP request fans out into at most this many engine requests (n x prompts).
MAX_CHOICES = 128


def _valid_unicode(value: str) -> str:
    """JSON may carry unpaired UTF-16 surrogates ("\\ud800"); tokenizers cannot encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains an unpaired surrogate at character {exc.start}; send valid Unicode") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


# What clients may send where a before-validator normalises the value (the schema of the
# normalised type would tell OpenAPI users that a plain string is not allowed).
_STRING = {"type": "string"}
_STRINGS = {"type": "array", "items": _STRING}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PARTS = {"type": "array", "items": {"type": "object", "properties": {"type": {"const": "text"}, "text": _STRING}}}
StopSchema = WithJsonSchema({"anyOf": [_STRING, _STRINGS, {"type": "null"}]})
ContentSchema = WithJsonSchema({"anyOf": [_STRING, _PARTS]})
PromptSchema = WithJsonSchema({"anyOf": [_STRING, _STRINGS, _IDS, {"type": "array", "items": _IDS}]})


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= TOKEN_ID_MAX


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Text, ContentSchema]

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> str:
        """A string, or a list of `{"type": "text", "text": ...}` parts (joined by newlines)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    def to_engine(self) -> dict[str, str]:
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class SamplingRequest(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Annotated[list[Text] | None, StopSchema] = None
    stop_token_ids: list[TokenId] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    ignore_eos: bool = False
    logit_bias: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("top_k", "max_tokens")
    @classmethod
    def _int32(cls, value: int | None) -> int | None:
        # Beyond int32 these cannot mean anything but "no limit"; keep them out of the engine's tensors.
        if value is not None and abs(value) > 2**31 - 1:
            raise ValueError("must fit in a 32-bit integer")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`); each endpoint has its own."""

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine sampling settings for one choice (n is fanned out by the caller). Raises
        `RequestError` naming the field that is out of range."""
        fields = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "stop_token_ids")
        given = {name: getattr(self, name) for name in fields if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs, **given)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type") != "text":
            raise ValueError("only response_format type 'text' is supported")
        return value

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`)."""
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name and wins when both are given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict[str, str]]:
        return [m.to_engine() for m in self.messages]


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (a batch).
    prompt: Annotated[list[str] | list[list[int]], PromptSchema]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_batch(cls, value: Any) -> Any:
        """Normalise to a list of prompts, with one clear message for every wrong shape (a plain
        union would report one error per alternative)."""
        if isinstance(value, str):
            return [_valid_unicode(value)]
        if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            return [value]
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return [_valid_unicode(p) for p in value]
        if isinstance(value, list) and value and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p)
                                                     for p in value):
            return value
        raise ValueError("prompt must be a non-empty string, list of strings, list of token ids "
                         f"(0..{TOKEN_ID_MAX}) or list of token-id lists")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`)."""
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (use n)", param="best_of")
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise RequestError(f"n x number of prompts must be at most {MAX_CHOICES}", param="n")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported (no prompt logprobs in streams)",
                               param="echo")


class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_combinations(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise RequestError("messages must not be empty", param="messages")


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]
