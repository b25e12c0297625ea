"""Tool calls in the model's text: the call format (`<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, the Hermes/Qwen form), the functions offered (`FunctionSpec`), and the parser that
turns a reply, streamed or whole, into content and calls. Shared by the HTTP endpoint and the
app's chat tabs.

The parser: `<tool_call>` blocks become calls, everything else stays content.

`ToolCallParser.feed(text)` returns events in order: `Text` (content), `CallStart` (a call's id
and name, as soon as the name is complete) and `CallArguments` (pieces of its arguments JSON, as
they arrive). The non-streaming response runs the same parser over the whole text, so both modes
agree: the arguments pieces of a call join to its `arguments` string.

Held back while undecided: text that may be the start of `<tool_call>`, trailing whitespace
(whitespace around calls is not content), and the end of a call's arguments that may be the
closing `}` of the call object or part of `</tool_call>`.

Small models often drop the tags: a reply that opens with the call object itself, bare or in a
```json fence (Qwen's template even shows it with doubled braces), is a call too when it names an
offered tool (`loose_names`), as llama.cpp's Hermes/Qwen parser takes it. Such a reply's first
characters are held until it is clear whether it opens that way, and a loose call until the end."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_END = "}\n" + CALL_CLOSE
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def call_begin(name: str) -> str:
    """The text of a call up to its arguments (also what the fallback prompt shows the model)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


@dataclass(frozen=True)
class FunctionSpec:
    """A function offered to the model: OpenAI's `{"type": "function", "function": {...}}`."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        # A function without parameters still takes an (empty) arguments object.
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}

    def openai(self) -> dict[str, Any]:
        """The tools entry, without the fields not given (as chat templates and prompts show it)."""
        function: dict[str, Any] = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                function[key] = getattr(self, key)
        return {"type": "function", "function": function}

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> FunctionSpec:
        function = tool.get("function", tool)
        return cls(function["name"], function.get("description"), function.get("parameters"), function.get("strict"))


@dataclass(frozen=True)
class NamedChoice:
    """tool_choice naming one function: exactly one call of it."""

    name: str


# "none" | "auto" | "required" | NamedChoice, as OpenAI's tool_choice.
ToolChoiceSpec = str | NamedChoice


# The call object's opening up to its arguments, with a non-space character after it (whitespace
# after the colon is not part of the arguments).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
# What may follow the arguments before `</tool_call>`: the call object's `}` and whitespace.
_ARGS_TAIL = " \t\r\n}"
# A reply opening with an untagged call object, in an optional ```json fence, braces maybe doubled.
_LOOSE_OPEN = re.compile(r'\s*(?:```(?:json)?\s*)?\{\{?\s*"name"\s*:')
_LOOSE_DECIDE = 40  # characters after which a reply that has not opened that way is content


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Text | CallStart | CallArguments


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _OpenCall:
    body: str = ""  # text after <tool_call>
    args_start: int | None = None  # where the arguments begin in `body`, once the header is complete
    sent: int = 0  # characters of the arguments already sent


@dataclass
class ToolCallParser:
    calls: list[ParsedCall] = field(default_factory=list)
    loose_names: frozenset[str] = frozenset()  # offered tools: an untagged call to one counts
    _pending: str = ""  # text not yet sent: a possible start of <tool_call>, or trailing whitespace
    _open: _OpenCall | None = None
    _start_decided: bool = False  # past the reply's opening (loose calls are looked for there only)
    _loose: str | None = None  # the reply so far, once it opened as an untagged call
    # The output ended inside a <tool_call> or an untagged call object (`finish` kept it as far as
    # it got); `unclosed_call`: it had got to be a call (its name complete), the last of `calls`.
    unclosed: bool = False
    unclosed_call: bool = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._loose is not None:
            self._loose += text
            return events
        self._pending += text
        if not self._start_decided and not self._decide_start():
            return events
        while self._pending:
            if self._open is None:
                if not self._scan_text(events):
                    break
            elif not self._scan_call(self._open, events):
                break
        return events

    def finish(self) -> list[Event]:
        """Flush what is held back at the end of the output (a cut-off call is kept as far as it got)."""
        events: list[Event] = []
        if self._loose is not None or not self._start_decided:
            self._start_decided = True
            text, self._loose = (self._loose if self._loose is not None else self._pending), None
            loose = _loose_call(text, self.loose_names)
            if loose is None:
                self.unclosed = self.unclosed or _unfinished_object(text)
                self._pending = ""
                return self.feed(text) + self.finish()
            name, arguments, rest = loose
            self._start(name, events)
            self._send_rest(_OpenCall(), arguments, events)
            if rest.strip():
                events.append(Text(rest.strip()))
            return events
        if self._open is not None:
            call, self._open, before = self._open, None, len(self.calls)
            self._close(call, events, closed=False)
            self.unclosed, self.unclosed_call = True, call.args_start is not None or len(self.calls) > before
        elif self._pending.strip():
            events.append(Text(self._pending))
        self._pending = ""
        return events

    def _decide_start(self) -> bool:
        """Whether the reply's opening is decided: True when it is content or tagged calls to
        parse as usual; False while held (it may be an untagged call, or it is one)."""
        if not self.loose_names:
            self._start_decided = True
            return True
        if _LOOSE_OPEN.match(self._pending):
            self._loose, self._pending = self._pending, ""
            return False
        head = self._pending.lstrip()
        if head[:1] in ("", "`", "{") and len(head) < _LOOSE_DECIDE:
            return False
        self._start_decided = True
        return True

    # --- between calls ---

    def _scan_text(self, events: list[Event]) -> bool:
        """Send the content before a call (or all that is decided); True when a call opened."""
        start = self._pending.find(CALL_OPEN)
        if start >= 0:
            # Whitespace before a call is layout, not content (the streamed and whole forms agree).
            before = self._pending[:start].rstrip()
            if before:
                events.append(Text(before))
            self._pending = self._pending[start + len(CALL_OPEN):]
            self._open = _OpenCall()
            return True
        keep = _partial_suffix(self._pending, CALL_OPEN)
        decided = self._pending[:len(self._pending) - keep]
        ready = decided.rstrip()
        if ready:
            events.append(Text(ready))
            self._pending = self._pending[len(ready):]
        return False

    # --- inside a call ---

    def _scan_call(self, call: _OpenCall, events: list[Event]) -> bool:
        """Advance the open call; True when it closed (and text after it is pending)."""
        call.body += self._pending
        self._pending = ""
        end = call.body.find(CALL_CLOSE)
        if end >= 0:
            self._pending = call.body[end + len(CALL_CLOSE):]
            call.body = call.body[:end]
            self._open = None
            self._close(call, events, closed=True)
            return True
        self._stream_arguments(call, events)
        return False

    def _stream_arguments(self, call: _OpenCall, events: list[Event]) -> None:
        if call.args_start is None:
            self._match_header(call, events)
            if call.args_start is None:
                return
        available = call.body[call.args_start:]
        available = available[:len(available) - _partial_suffix(available, CALL_CLOSE)].rstrip(_ARGS_TAIL)
        if len(available) > call.sent:
            events.append(CallArguments(len(self.calls) - 1, available[call.sent:]))
            call.sent = len(available)

    def _close(self, call: _OpenCall, events: list[Event], closed: bool) -> None:
        if call.args_start is None:
            self._match_header(call, events)
        if call.args_start is not None:
            self._send_rest(call, _arguments_text(call.body[call.args_start:]), events)
            return
        whole = _whole_call(call.body)
        if whole is None:  # not a call after all: the text goes out as it was written
            events.append(Text(CALL_OPEN + call.body + (CALL_CLOSE if closed else "")))
            return
        name, arguments = whole
        self._start(name, events)
        self._send_rest(call, arguments, events)

    def _match_header(self, call: _OpenCall, events: list[Event]) -> None:
        header = _HEADER.match(call.body)
        if header is not None:
            call.args_start = header.end()
            self._start(header.group(1), events)

    def _start(self, name: str, events: list[Event]) -> None:
        self.calls.append(ParsedCall(new_call_id(), name))
        events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))

    def _send_rest(self, call: _OpenCall, arguments: str, events: list[Event]) -> None:
        rest = arguments[call.sent:]
        if rest:
            events.append(CallArguments(len(self.calls) - 1, rest))
        self.calls[-1].arguments = arguments


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _arguments_text(tail: str) -> str:
    """The arguments JSON from what follows the header: without the call object's closing `}`
    where that leaves valid JSON (a model may also forget that brace)."""
    tail = tail.rstrip()
    if tail.endswith("}"):
        inner = tail[:-1].rstrip()
        if _is_json(inner) or not _is_json(tail):
            return inner
    return tail


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object written in another key order, else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj)


def _call_of(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str) and _is_json(arguments):
        return obj["name"], arguments
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _loose_call(text: str, names: frozenset[str]) -> tuple[str, str, str] | None:
    """(name, arguments JSON, text after it) of a reply that is an untagged call to one of
    `names`, else None."""
    opening = _LOOSE_OPEN.match(text)
    if opening is None:
        return None
    start = text.index("{", opening.start())
    doubled = text.startswith("{{", start)
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start + doubled)
    except ValueError:
        return None
    call = _call_of(obj)
    if call is None or call[0] not in names:
        return None
    for _ in range(2 if doubled else 0):  # `}}` closing `{{`, and a brace too many at times
        if text[end:].lstrip().startswith("}"):
            end = text.index("}", end) + 1
    rest = text[end:].lstrip()
    if rest.startswith("```"):
        rest = rest[3:]
    return *call, rest


def _unfinished_object(text: str) -> bool:
    """Whether `text` opens as an untagged call object that does not end (the output stopped in it)."""
    opening = _LOOSE_OPEN.match(text)
    if opening is None:
        return False
    start = text.index("{", opening.start())
    try:
        json.JSONDecoder().raw_decode(text, start + text.startswith("{{", start))
    except ValueError:
        return True
    return False


def collect(text: str, loose_names: frozenset[str] = frozenset()) -> tuple[str | None, list[ParsedCall]]:
    """The whole output's content (None when it is only calls) and calls."""
    parser = ToolCallParser(loose_names=loose_names)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    return (content if content.strip() or not parser.calls else None), parser.calls
