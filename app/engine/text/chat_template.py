"""Chat templates: the model file's own Jinja2 template, else one shipped for its format, rendered
in a sandbox because the file is untrusted."""

from __future__ import annotations

import datetime
import json
from collections.abc import Container, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from app import ASSETS_DIR
from app.engine.text.error_text import one_line
from app.engine.types.errors import RequestError

CHAT_TEMPLATE_DIR = ASSETS_DIR / "chat_templates"

# A file without a template gets the shipped one whose special tokens its vocabulary has; the
# first match wins because some vocabularies carry more than one family's tokens.
_FALLBACK_MARKERS = (("<start_of_turn>", "gemma3"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"))


class ChatTemplate:
    """A conversation renderer: `source` is the Jinja2 text, `name` "gguf" when it came from the
    model file, else the name of the shipped template used instead."""

    def __init__(self, source: str, name: str) -> None:
        self.source = source
        self.name = name
        # Compiled on first use: a syntax error surfaces as a request error, not a load failure.
        self._compiled: jinja2.Template | None = None

    @classmethod
    def for_model(cls, metadata: Mapping[str, Any], architecture: str, vocab: Container[str]) -> ChatTemplate:
        """The template in the GGUF metadata, else the shipped one matching `vocab`'s tokens."""
        template = metadata.get("tokenizer.chat_template")
        if isinstance(template, str) and template.strip():
            return cls(template, "gguf")
        name = _fallback_name(architecture, vocab)
        return cls((CHAT_TEMPLATE_DIR / f"{name}.jinja").read_text("utf-8"), name)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               special_tokens: Mapping[str, str], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as prompt text; `special_tokens` fills `bos_token`, `eos_token`...;
        `tools` (OpenAI function definitions) reach templates that render them (Qwen's, Hermes').
        Every failure, the template's own included, is a RequestError about the messages."""
        _check_messages(messages)
        template = self._template()
        context: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                                   **special_tokens}
        if tools:
            context["tools"] = list(tools)
        try:
            return template.render(context)
        except RequestError:
            raise
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template error: {one_line(e)}", param="messages") from None
        except Exception as e:  # TypeError, KeyError ... raised by a template's own operations
            raise RequestError(f"chat template failed: {type(e).__name__}: {one_line(e)}",
                               param="messages") from None

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _chat_environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as e:
                raise RequestError(f"the model's chat template is invalid: {one_line(e)} (line {e.lineno})",
                                   param="messages") from None
        return self._compiled


def _fallback_name(architecture: str, vocab: Container[str]) -> str:
    for marker, name in _FALLBACK_MARKERS:
        if marker in vocab:
            return name
    return "gemma3" if architecture.startswith("gemma") else "chatml"


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")


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


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates want plain JSON (as transformers renders it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
