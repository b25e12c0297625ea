"""Request bodies of the OpenAI-compatible routes (pydantic models, strict types).

Unknown fields are ignored (OpenAI clients send fields such as `user` that change nothing here);
known fields of the wrong type or out of range are rejected, and so are features this server does
not implement (images) rather than silently ignoring them. The fields that shape the
output (response formats, tools, logit bias) are in `output_schema`.
Range checks that `SamplingParams` already makes are left to it, so the TUI and the HTTP API share
one set of rules and messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
)

from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from app.server.output_schema import (
    ResponseFormat,
    SchemaLike,
    StructuredOutputs,
    ToolChoice,
    ToolDefinition,
    object_or_string,
    parse_logit_bias,
    parse_tool_choice,
)

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


class ToolCallFunction(_Body):
    name: Text
    # A JSON string, as OpenAI sends it; an object is accepted too (some clients send one).
    arguments: Annotated[Text | dict[str, Any], BeforeValidator(object_or_string)] = "{}"


class ToolCall(_Body):
    """A call an earlier assistant turn made, sent back as conversation history."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only where OpenAI allows it: an assistant turn that made tool calls.
    content: Annotated[Text | None, ContentSchema] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> str | None:
        """A string, or a list of `{"type": "text", "text": ...}` parts (joined by newlines)."""
        if isinstance(value, str) or value is None:
            return value
        # ValueError, not TypeError: pydantic turns only ValueError into a validation error (a 400).
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")  # noqa: TRY004
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a string 'text'")  # noqa: TRY004
            texts.append(part["text"])
        return "\n".join(texts)

    def check(self, i: int) -> None:
        """Cross-field rules; `i` is the message's index, for the error's `param`."""
        if self.role == "tool" and not self.tool_call_id:
            raise RequestError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                               param=f"messages[{i}].tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise RequestError(f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise RequestError(f"messages[{i}]: content is required (it may be null only in an assistant "
                               "message with tool_calls)", param=f"messages[{i}].content")

    def to_engine(self) -> dict[str, str]:
        """The message as plain chat-template input (tool turns are rewritten by `tool_prompt`)."""
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content or ""}


def check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    for i, message in enumerate(messages):
        message.check(i)


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
    logit_bias: Annotated[dict[int, float] | None, WithJsonSchema(
        {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]})] = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs' fields.
    guided_json: SchemaLike | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context leaves room for).
    truncate_prompt_tokens: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        return parse_logit_bias(value)

    @field_validator("top_k", "max_tokens")
    @classmethod
    def _int32(cls, value: int | None) -> int | None:
        # Beyond int32 these cannot mean anything but "no limit"; keep them out of the engine's tensors.
        if value is not None and abs(value) > 2**31 - 1:
            raise ValueError("must fit in a 32-bit integer")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        """0 or below -1 cannot mean a number of tokens to keep."""
        if value is not None and (value == 0 or value < -1):
            raise ValueError(f"must be a positive number of tokens to keep, or -1 for as many as fit; got {value}")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`); each endpoint has its own."""

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        constraint: dict[str, Any] | None = None) -> SamplingParams:
        """Engine sampling settings for one choice (n is fanned out by the caller); `constraint` holds
        the output-constraint fields (see `response_format.Constraint`). Raises `RequestError`
        naming the field that is out of range."""
        fields = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "stop_token_ids", "logit_bias")
        given = {name: getattr(self, name) for name in fields if getattr(self, name) is not None}
        given.update(constraint or {})
        return SamplingParams(max_tokens=max_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs, **given)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Annotated[ToolChoice | None, WithJsonSchema(
        {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}, {"type": "null"}]})] = None
    parallel_tool_calls: bool = True
    # localbatch's: what to do when the conversation does not fit the context (see `context_overflow`).
    context_overflow: Literal["error", "drop_oldest"] = "error"

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> ToolChoice | None:
        return parse_tool_choice(value)

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`)."""
        check_messages(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tools: function names must be unique", param="tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise RequestError("tool_choice needs tools to choose from", param="tool_choice")
        if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
            raise RequestError(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                               param="tool_choice")

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name and wins when both are given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (a batch).
    prompt: Annotated[list[str] | list[list[int]], PromptSchema]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Text after the cursor: the prompt is the text before it, the reply the middle (see `fim`).
    suffix: Text | None = None
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

    def check_combinations(self) -> None:
        """Cross-field rules (pydantic would report them without a `param`)."""
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (use n)", param="best_of")
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise RequestError(f"n x number of prompts must be at most {MAX_CHOICES}", param="n")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported (no prompt logprobs in streams)",
                               param="echo")
        if self.suffix is not None and self.echo:
            raise RequestError("echo together with suffix is not supported (the prompt is a fill-in-the-middle "
                               "prompt then)", param="echo")
        if self.suffix is not None and self.truncate_prompt_tokens is not None:
            raise RequestError("truncate_prompt_tokens together with suffix is not supported: fill-in-the-middle "
                               "prompts keep the end of the prompt and the start of the suffix themselves",
                               param="truncate_prompt_tokens")


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
        if self.messages is not None:
            check_messages(self.messages)


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]

