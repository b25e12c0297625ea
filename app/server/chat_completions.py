"""POST /v1/chat/completions: `chat.completion` objects and `chat.completion.chunk` events, with
response formats and tool calls."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import Response

from app.engine.api.tool_use import CallStart, Event, ParsedCall, Text, ToolCallParser, collect, tool_structural_tag
from app.engine.types.errors import RequestError
from app.engine.types.outputs import StreamDelta, TopLogprobs
from app.server.context_overflow import DROPPED_HEADER, fit_conversation, truncated, truncation_length
from app.server.logprobs import chat_logprobs
from app.server.openai_schema import ChatCompletionRequest
from app.server.output_schema import ToolChoice
from app.server.response_format import Constraint, constrained_params, output_constraint
from app.server.serving import Endpoint, ServerState, handle_generation
from app.server.streams import Choice
from app.server.tool_prompt import choice_spec, function_specs


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await handle_generation(request, body, _Chat)


class _Chat(Endpoint):
    """One conversation, templated by the engine; the reply is an assistant message, whose tool
    calls (when tools are offered) are parsed out of the text."""

    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, body: ChatCompletionRequest) -> None:
        choice = body.effective_tool_choice
        self.tools_offered = choice != "none" and bool(body.tools)
        max_tokens = body.requested_max_tokens()
        prompt, dropped = fit_conversation(state, body.messages, body.context_overflow, max_tokens,
                                           body.tools or [], choice)
        keep = truncation_length(body.truncate_prompt_tokens, state.engine.max_model_len, max_tokens)
        prompt, _ = truncated(state, prompt, keep)
        constraint = chat_constraint(body, choice)
        # No max_tokens: the engine generates until the context (or the KV pool) is full.
        params = constrained_params(body, max_tokens, body.engine_logprobs(), constraint)
        renames = {"prompt": "messages", **(constraint.renames() if constraint else {})}
        super().__init__(state, [prompt], params, renames)
        if dropped:
            self.headers[DROPPED_HEADER] = str(dropped)
        self.body = body
        self._parsers: dict[int, ToolCallParser] = {}
        self._names = frozenset(t.function.name for t in body.tools or []) if self.tools_offered else frozenset()

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        return [_entry(choice, {"role": "assistant", "content": ""})]

    def streamed(self, choice: Choice, delta: StreamDelta) -> list[dict[str, Any]]:
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or []) if delta.token_ids else None
        if self.tools_offered:
            entries = self._tool_entries(choice, delta)
        else:
            entries = [_entry(choice, {"content": delta.text})] if delta.text else []
        if logprobs:
            if entries:
                entries[0]["logprobs"] = logprobs
            else:  # text held back (a possible tool call): the logprobs still go out now
                entries.append(_entry(choice, {}, logprobs=logprobs))
        # The finish reason comes alone, in a chunk with an empty delta, as OpenAI sends it.
        if delta.finish_reason is not None:
            calls = self._parsers[choice.index].calls if self.tools_offered else []
            entries.append(_entry(choice, {}, finish_reason=finish_reason(delta.finish_reason, calls)))
        return entries

    def whole(self, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ParsedCall] = []
        if self.tools_offered:
            message["content"], calls = collect(text, self._names)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": finish_reason(choice.finish_reason, calls)}

    def _tool_entries(self, choice: Choice, delta: StreamDelta) -> list[dict[str, Any]]:
        parser = self._parsers.setdefault(choice.index, ToolCallParser(loose_names=self._names))
        events = parser.feed(delta.text)
        if delta.finish_reason is not None:
            events += parser.finish()
        return [_entry(choice, _event_delta(e)) for e in events]

    def _logprobs(self, token_ids: list[int], dists: list[TopLogprobs]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.texts, token_ids, dists, self.body.top_logprobs or 0)


def chat_constraint(body: ChatCompletionRequest, choice: ToolChoice) -> Constraint | None:
    """The output constraint: the response format, the tool calls, or (tools under "auto" next
    to a JSON response format) either. A forced call is this turn's output: the response format
    applies to the answer written after its results."""
    answer = output_constraint(body)
    if choice == "none" or not body.tools:
        return answer
    answer_schema = None
    if answer is not None and choice == "auto":
        answer_schema = answer.json_schema
        if answer_schema is None:
            raise RequestError(f"{answer.param}: only a JSON format can be combined with tools "
                               '(tool_choice "auto")', param=answer.param)
    tag = tool_structural_tag(function_specs(body.tools), choice_spec(choice), body.parallel_tool_calls, answer_schema)
    return Constraint({"structural_tag": tag}, "tools") if tag is not None else answer


def finish_reason(reason: str | None, calls: list[ParsedCall]) -> str | None:
    # A reply that ended by itself after calling tools is waiting for their results.
    return "tool_calls" if calls and reason == "stop" else reason


def _event_delta(event: Event) -> dict[str, Any]:
    if isinstance(event, Text):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def _entry(choice: Choice, delta: dict[str, Any], finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
