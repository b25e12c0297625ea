"""One task, run headless as a chat tab runs it: the model's turn (an `Agent`), its calls through
`app.tools` (`ToolLoop`, every call approved), their results back as `tool` messages, up to the
step limit; then the task's checker. Every call the model writes is checked on its own: it names
an offered tool and its arguments are a JSON object valid for that tool's `inputSchema`.

Agents:
- `EngineAgent`: an in-process engine through `tool_request` (the app's prompt and parser), with
  the call constraint on (its structural tag) or off (the same prompt, free decoding);
- `OpenAIAgent`: an OpenAI-compatible server (`/v1/chat/completions` with `tools`), its
  `tool_calls` read back; for llama-server `--jinja` or `localbatch serve`."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from jsonschema import Draft202012Validator

from app.engine.api.engine_client import EngineClient
from app.engine.api.tool_use import ParsedCall, Text, tool_request
from app.engine.text.tool_calls import CALL_OPEN
from app.engine.types.errors import LocalbatchError
from app.engine.types.sampling_params import SamplingParams
from app.tools.approval import ApprovalPolicy, Decision, StepLimit
from app.tools.guidance import cut_call_cause, next_tool_choice, with_guidance
from app.tools.turn import CallCard, ToolLoop, ToolRunner

from .tasks import Task, check, copy_fixture


@dataclass
class Reply:
    """One model turn."""

    content: str
    calls: list[ParsedCall]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


class Agent(Protocol):
    mode: str  # "on", "off", "url"
    model: str
    max_tokens: int

    async def turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]]) -> Reply: ...


class EngineAgent:
    """The engine through the app's `tool_request`, with the call constraint on or off; mode
    "first" is "on" with the task's first turn made to call a tool (tool_choice "required")."""

    def __init__(self, engine: EngineClient, constrained: bool, max_tokens: int, first_required: bool = False) -> None:
        self.engine = engine
        self.mode = "first" if first_required else "on" if constrained else "off"
        self.model = engine.model_name
        self.max_tokens = max_tokens
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]]) -> Reply:
        try:
            first = self.mode == "first" and not any(m.get("role") == "tool" for m in messages)
            request = tool_request(self.engine, messages, tools, self.params,
                                   "required" if first else next_tool_choice(messages))
        except LocalbatchError as e:
            return Reply("", [], error=str(e))
        params = self.params if self.mode == "off" else request.params
        parser = request.parser()
        text, last = "", None
        try:
            async for delta in self.engine.stream(request.prompt, params):
                text += delta.text
                last = delta
        except LocalbatchError as e:
            return Reply("", [], error=str(e).splitlines()[0])
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, Text))
        reply = Reply(content, list(parser.calls))
        if last is not None:
            reply.prompt_tokens, reply.cached_tokens = last.num_prompt_tokens, last.num_cached_tokens
            reply.output_tokens, reply.finish_reason = last.num_output_tokens, last.finish_reason
            reply.error = last.error
        return reply


class OpenAIAgent:
    """An OpenAI-compatible server: the same messages and tools in its `tools` field."""

    mode = "url"

    def __init__(self, url: str, max_tokens: int, model: str | None = None, timeout_s: float = 900.0) -> None:
        self.base = url.rstrip("/").removesuffix("/v1")
        self.max_tokens = max_tokens
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self.model = model or "default"

    async def resolve_model(self) -> None:
        """The server's first model id, when none was named."""
        if self.model != "default":
            return
        try:
            listed = (await self.client.get(f"{self.base}/v1/models")).json()
            self.model = listed["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            pass

    async def turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]]) -> Reply:
        body = {"model": self.model, "messages": list(messages), "tools": list(tools),
                "tool_choice": next_tool_choice(messages),
                "temperature": 0.0, "max_tokens": self.max_tokens, "stream": False}
        try:
            response = await self.client.post(f"{self.base}/v1/chat/completions", json=body)
            data = response.json()
        except (httpx.HTTPError, ValueError) as e:
            return Reply("", [], error=f"{type(e).__name__}: {e}")
        if response.status_code != 200 or "choices" not in data:
            return Reply("", [], error=f"HTTP {response.status_code}: {json.dumps(data)[:200]}")
        choice = data["choices"][0]
        message = choice.get("message") or {}
        calls = [ParsedCall(c.get("id") or f"call_{i}", c["function"].get("name", ""),
                            _arguments_text(c["function"].get("arguments")))
                 for i, c in enumerate(message.get("tool_calls") or [])]
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply(message.get("content") or "", calls, usage.get("prompt_tokens", 0), cached,
                     usage.get("completion_tokens", 0), choice.get("finish_reason"))

    async def aclose(self) -> None:
        await self.client.aclose()


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


_BARE_CALL = re.compile(r'\s*(```\w*\s*)?\{\s*"name"\s*:')


# --- calls checked on their own -------------------------------------------------------------------


def call_problem(call: ParsedCall, schemas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why `call` is not a valid call of an offered tool, or None when it is."""
    if call.name not in schemas:
        return f"no tool named {call.name!r}"
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        return "arguments are not JSON"
    if not isinstance(arguments, dict):
        return "arguments are not an object"
    error = next(iter(Draft202012Validator(dict(schemas[call.name])).iter_errors(arguments)), None)
    return None if error is None else f"arguments do not match the schema: {error.message[:120]}"


def unparsed_calls(content: str) -> int:
    """Calls written that did not parse: `<tool_call>` openings left in the text, or a reply that
    is a bare call object (`{"name": ...}`) naming no offered tool."""
    return content.count(CALL_OPEN) or int(bool(_BARE_CALL.match(content)))


# --- one task -------------------------------------------------------------------------------------


@dataclass
class TaskRun:
    model: str
    mode: str
    task: str
    kind: str
    ok: bool
    why: str
    turns: int = 0
    calls: int = 0
    valid_calls: int = 0
    cut_calls: int = 0  # calls the per-turn token cap ended before they closed (not invalid: unfinished)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    stopped: str = ""  # "", "step limit", "max_tokens", "error"
    answer: str = ""
    problems: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["answer"] = self.answer[:300]
        out["problems"] = "; ".join(self.problems)
        out["wall_s"] = round(self.wall_s, 2)
        return out


async def approve_all(card: CallCard) -> Decision:
    return Decision.ALWAYS


async def run_task(agent: Agent, task: Task, tools: ToolRunner, offered: Sequence[dict[str, Any]], root: Path,
                   steps: int) -> TaskRun:
    """`task` from a fresh copy of the fixture at `root` (the tools' working directory)."""
    copy_fixture(root)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in offered}
    # As a chat tab sends it: the tools' guidance as the system message (every mode alike).
    messages = with_guidance([{"role": "user", "content": task.prompt}], offered)
    loop = ToolLoop(tools, ApprovalPolicy(), StepLimit(steps))
    run = TaskRun(agent.model, agent.mode, task.id, task.kind, False, "")
    start = time.perf_counter()
    while True:
        reply = await agent.turn(messages, offered)
        run.turns += 1
        run.prompt_tokens += reply.prompt_tokens
        run.cached_tokens += reply.cached_tokens
        run.output_tokens += reply.output_tokens
        _count_calls(run, reply, schemas)
        if reply.error:
            run.stopped, run.answer = "error", reply.content
            run.problems.append(reply.error)
            break
        if not reply.calls:
            run.answer = reply.content
            run.stopped = "max_tokens" if reply.finish_reason == "length" else ""
            break
        messages.append({"role": "assistant", "content": reply.content,
                         "tool_calls": [c.openai() for c in reply.calls]})
        # A call the token cap ended is answered as the chat answers it.
        cut = cut_call_cause(agent.max_tokens) if reply.finish_reason == "length" else None
        results = await loop.run(reply.calls, approve_all, cut)
        if results is None:
            run.stopped = "step limit"
            break
        messages += results
    run.wall_s = time.perf_counter() - start
    verdict = check(task, run.answer, root)
    run.ok, run.why = verdict.ok, verdict.why or run.stopped
    return run


def _count_calls(run: TaskRun, reply: Reply, schemas: Mapping[str, Mapping[str, Any]]) -> None:
    """Each call written is valid, invalid (a reason in `problems`), or cut: when the turn hit its
    token cap, the last call written, if it is not valid, was still being written."""
    broken = unparsed_calls(reply.content)
    run.calls += len(reply.calls) + broken
    problems = [(call.name, call_problem(call, schemas)) for call in reply.calls]
    problems += [("(not parsed)", "did not parse")] * broken
    cut = reply.finish_reason == "length" and problems and problems[-1][1] is not None
    for i, (name, problem) in enumerate(problems):
        if problem is None:
            run.valid_calls += 1
        elif cut and i == len(problems) - 1:
            run.cut_calls += 1
            run.problems.append(f"{name}: cut by the token cap ({problem})")
        else:
            run.problems.append(f"{name}: {problem}")


# --- figures per model and mode -------------------------------------------------------------------


def summarize(runs: Sequence[TaskRun]) -> list[dict[str, Any]]:
    """One row per (model, mode): success, the valid-call rate (of the calls finished: a call the
    token cap cut is counted apart, as `cut_calls`, and `invalid_calls` are the rest), turns,
    tokens and time per task."""
    rows = []
    for key in dict.fromkeys((r.model, r.mode) for r in runs):
        group = [r for r in runs if (r.model, r.mode) == key]
        n, calls, cut = len(group), sum(r.calls for r in group), sum(r.cut_calls for r in group)
        answers = [r for r in group if r.kind not in ("fix", "edit")]
        edits = [r for r in group if r.kind in ("fix", "edit")]
        rows.append({
            "model": key[0], "mode": key[1], "tasks": n,
            "success_pct": _pct(sum(r.ok for r in group), n),
            "answer_success_pct": _pct(sum(r.ok for r in answers), len(answers)),
            "edit_success_pct": _pct(sum(r.ok for r in edits), len(edits)),
            "calls": calls, "valid_call_pct": _pct(sum(r.valid_calls for r in group), calls - cut),
            "cut_calls": cut, "invalid_calls": calls - cut - sum(r.valid_calls for r in group),
            "turns_mean": round(sum(r.turns for r in group) / n, 2),
            "prompt_tokens_mean": round(sum(r.prompt_tokens for r in group) / n),
            "output_tokens_mean": round(sum(r.output_tokens for r in group) / n),
            "wall_s_mean": round(sum(r.wall_s for r in group) / n, 1),
            "step_limit_stops": sum(r.stopped == "step limit" for r in group),
            "errors": sum(r.stopped == "error" for r in group),
        })
    return rows


def _pct(part: int, whole: int) -> float | None:
    return round(100 * part / whole, 1) if whole else None
