"""One chat as a model, without a screen: its record and messages (persisted through the store),
the next message's draft, its use of the context, the request it sends and the reply it commits,
and what edits it: regenerate, take a turn back, fork, rename, settings. A tab (`ui.chat.ChatPane`)
is a view of one; tests drive it with a fake engine alone.

A reply runs as `begin_reply()` (at once: the tab shows it is generating) then `respond()` (the
task that streams it into the view's `ReplyView`). What `respond` does, in order: the view opens
the reply's sink, `Reply.stream` feeds it the engine's deltas, the view closes it (its final
rendering), the reply is committed to the store and appended, and the view shows how it ended.

Tool turns plug in at one place, `respond`'s loop. While `tool_runner` (a `tools.ChatTools`)
offers tools and the chat's settings have them on, the request is `tool_request`'s (the tools in
the template's prompt, the call constraint, a parser): the reply's text reaches the view less
its calls, and a reply that ends with calls (`ReplyEnd.tool_calls`) is committed with them.
`tool_runner.run` (awaited: its I/O is off the UI thread) returns their results, each appended
as a "tool" message (`add_tool_result`) and shown (`ReplyView.tool_result`); then the next reply
begins from the chat as it now stands, in a sink the view opens for it. The step limit or a
cancel (esc during a call) ends the loop with a note (`ReplyView.note`). The history the model
reads (`history.chat_history`) carries assistant tool calls and tool results as OpenAI-style
messages, so the continuation's prompt starts with the tokens of the one before it (the prefix
cache serves them); and every edit below works on whole turns (a user message and everything
after it), so a turn's calls and their results stay together through
regenerate, take-back, fork and the context's overflow policy."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from app.engine.api.engine_client import EngineClient
from app.engine.api.tool_use import ToolCallParser, tool_request
from app.tools.guidance import next_tool_choice, with_guidance
from app.ui.attach import split_message
from app.ui.session.context_fit import ContextBudget, ContextPlan
from app.ui.session.draft import Draft
from app.ui.session.history import build_request, chat_history
from app.ui.session.reply import Reply, ReplyEnd, ReplySink
from app.ui.store import ChatRecord, ChatStore, MessageRecord
from app.ui.user_config import ChatSettings

# What changed, for the view (`ChatSession.on_change`).
TITLE, SETTINGS, ATTACHMENTS, GENERATING = "title", "settings", "attachments", "generating"

_DEFAULT_TITLE = re.compile(r"^Chat \d+$")


class ReplyView(Protocol):
    """What a view does for each reply `respond` streams."""

    async def opened(self, reply: Reply) -> ReplySink:
        """The reply's view is ready: the sink its text goes to."""
        ...

    async def closing(self, reply: Reply, end: ReplyEnd) -> None:
        """The stream ended: the final rendering, before the reply is committed."""
        ...

    def closed(self, reply: Reply, message: MessageRecord | None, end: ReplyEnd) -> None:
        """Committed (`message`; None: it had no text): show how it ended."""
        ...

    def tool_result(self, message: MessageRecord) -> None:
        """A call's result, stored: show it."""
        ...

    def note(self, text: str) -> None:
        """Why the tool loop ended early (the step limit, a cancel)."""
        ...


class ToolRunner(Protocol):
    """Runs a reply's tool calls (OpenAI's shape); returns (tool_call_id, name, content) per call
    (none: the step limit stopped the loop, `limit_reached`; `cancelled`: esc ended the round)."""

    limit_reached: bool
    cancelled: bool
    limit_message: str

    def offered(self) -> list[dict[str, Any]]:
        """The tools to offer (OpenAI `tools` entries); none: a plain request."""
        ...

    def new_turn(self) -> None: ...

    async def run(self, calls: list[dict[str, Any]], cut: str | None = None) -> list[tuple[str, str, str]]: ...


class ChatSession:
    """See the module docstring. Used from the UI thread (or one test's event loop) only."""

    def __init__(self, chat: ChatRecord, messages: list[MessageRecord], engine: EngineClient, store: ChatStore) -> None:
        self.chat = chat
        self._messages = list(messages)
        self._engine = engine
        self._store = store
        self.on_change: Callable[[str], None] = lambda what: None  # the view's, one of TITLE ... GENERATING
        self.draft = Draft(lambda: self.on_change(ATTACHMENTS))
        self.context = ContextBudget(engine)
        self.reply: Reply | None = None  # the latest reply, running or ended
        self.tool_runner: ToolRunner | None = None  # the chat's tools (`tools.ChatTools`), if the app has any
        self.running_tools = False  # a round of calls is asked or running (esc cancels it)

    # state

    @property
    def generating(self) -> bool:
        return self.running_tools or (self.reply is not None and self.reply.running)

    @property
    def request_id(self) -> str | None:
        """The running reply's request id (the engine's stats name it)."""
        return self.reply.request_id if self.generating else None

    @property
    def messages(self) -> list[MessageRecord]:
        return list(self._messages)

    def history(self) -> list[dict[str, Any]]:
        return chat_history(self.chat.system_prompt, self._messages)

    def request(self) -> tuple[Any, ...]:
        """What the next reply is generated from, as the last fit planned it: with tools offered
        (`tool_runner`'s, unless this chat's settings turn them off or the model has no chat
        template), through `tool_request` (the template's tool prompt, calls constrained to the
        tools' schemas), with the parser of its reply; for a remote engine, the chat messages and
        the tools for the server's OpenAI `tools` field (the server renders and constrains them)."""
        plan = self.context.plan
        prompt, params = build_request(self.history(), self.chat.settings, self._engine.chat_template,
                                       left_out=plan.left_out, max_tokens=plan.max_tokens)
        tools = offered_tools(self.tool_runner, self.chat.settings, self._engine)
        if not tools:
            return prompt, params, None
        prompt = with_guidance(prompt, tools)
        choice = next_tool_choice(prompt)
        if self._engine.is_remote:
            return prompt, params, ToolCallParser(loose_names=frozenset(t["function"]["name"] for t in tools)), \
                {"tools": tools, "tool_choice": choice}
        turn = tool_request(self._engine, prompt, tools, params, choice)
        return turn.prompt, turn.params, turn.parser()

    def chat_tokens(self, recount: bool = False) -> int:
        self.context.offer(offered_tools(self.tool_runner, self.chat.settings, self._engine))
        history = self.history() if self._messages or self.chat.system_prompt else []
        return self.context.chat_tokens(history, recount)

    def draft_tokens(self, text: str) -> int:
        """What the message being written adds (its `@path` files that cannot be read left out)."""
        if not text and not self.draft.attachments:
            return 0
        return self.context.count([{"role": "user", "content": self.draft.message(text)}])

    def left_out_messages(self) -> int:
        """How many of the oldest messages the last request went without (0: none)."""
        return self.context.plan.left_out_messages(self.history())

    def recall_prompts(self) -> list[str]:
        """Prompts sent before, newest first: this chat's, then every other chat's (the store's)."""
        own = [split_message(m.content)[1] for m in reversed(self._messages) if m.role == "user"]
        seen: set[str] = set()
        out = []
        for text in own + [split_message(t)[1] for t in self._store.recent_prompts()]:
            if text and text not in seen:
                seen.add(text)
                out.append(text)
        return out

    # sending

    def prepare_message(self, text: str) -> tuple[str, ContextPlan]:
        """The message `text` makes (the draft's files first) and its request's fit; raises a
        `LocalbatchError` (a file cannot be read, the context says no) and nothing changes."""
        content = self.draft.message(text, strict=True)
        self.context.offer(offered_tools(self.tool_runner, self.chat.settings, self._engine))
        return content, self.context.fit([*self.history(), {"role": "user", "content": content}], self.chat.settings)

    def add_user_message(self, text: str, content: str, plan: ContextPlan) -> MessageRecord:
        """Store and append the message `prepare_message` made of `text`; the draft empties and a
        chat still named "Chat N" takes its title from the text."""
        message = self._store.add_message(self.chat.id, "user", content)
        self._messages.append(message)
        # The count with this message is the one just made, unless turns were left out of it.
        self.context.counted(None if plan.left_out else plan.used)
        self.draft.set_attachments([])
        if self.tool_runner is not None:
            self.tool_runner.new_turn()
        if _DEFAULT_TITLE.match(self.chat.title):
            self.rename(_title_from(text))
        return message

    def begin_reply(self) -> Reply:
        """A reply starts (the engine is asked in `respond`): from here on the chat is generating."""
        self.reply = Reply(f"chat{self.chat.id}-{uuid.uuid4().hex[:8]}", self._store, self.chat.id,
                           self._engine.model_name)
        self.on_change(GENERATING)
        return self.reply

    async def respond(self, reply: Reply, view: ReplyView, max_delay_s: float = 0.0) -> None:
        """Stream `reply` into `view` and commit it; then, while replies end in tool calls and a
        `tool_runner` is set, their results and the next reply (see the module docstring)."""
        runner = self.tool_runner
        while True:
            end = await self._turn(reply, view, max_delay_s)
            if end.cut_call is not None and not end.tool_calls:  # cut before it was a call: nothing to answer
                view.note(f"{end.cut_call[:1].upper()}{end.cut_call[1:]}; no call ran (raise max tokens in the "
                          "chat's settings)")
            if not end.tool_calls or runner is None or reply.stop_requested:
                return
            self.running_tools = True
            try:
                results = await runner.run(end.tool_calls, end.cut_call)
                for call_id, name, content in results:
                    view.tool_result(self.add_tool_result(call_id, name, content))
            finally:
                self.running_tools = False
                self.on_change(GENERATING)
            if runner.limit_reached or runner.cancelled:
                view.note(runner.limit_message if runner.limit_reached else "Cancelled: the model was told.")
                return
            reply = self.begin_reply()

    async def _turn(self, reply: Reply, view: ReplyView, max_delay_s: float) -> ReplyEnd:
        sink = await view.opened(reply)
        end = await reply.stream(self._engine, self.request, sink, max_delay_s)
        await view.closing(reply, end)
        text = sink.text
        message = None
        if text or end.tool_calls:  # committed at once: a crash from here on loses nothing of it
            message = reply.commit(text, end.finish_reason, end.tool_calls)
            self._messages.append(message)
        else:
            reply.discard()
        reply.finish_reason = end.finish_reason
        reply.running = False
        view.closed(reply, message, end)
        self.on_change(GENERATING)
        return end

    def stop(self) -> bool:
        """Abort the running reply (its text so far is still committed); False when none runs.
        While calls run the view cancels its task instead (`running_tools`)."""
        reply = self.reply
        if self.running_tools:
            return True
        if reply is None or not reply.running:
            return False
        reply.stop_requested = True
        self._engine.abort(reply.request_id)
        return True

    def add_tool_result(self, tool_call_id: str, name: str, content: str) -> MessageRecord:
        """A tool's result for one call of the last reply, as the model reads it next."""
        message = self._store.add_message(self.chat.id, "tool", content, tool_call_id=tool_call_id, name=name)
        self._messages.append(message)
        self.context.counted(None)
        return message

    # editing

    def prepare_regenerate(self) -> ContextPlan:
        """The fit of the last turn generated again (its replies left out); raises a
        `LocalbatchError` when the context says no, and nothing changes."""
        kept = self._messages[:_last_turn_end(self._messages)]
        self.context.offer(offered_tools(self.tool_runner, self.chat.settings, self._engine))
        return self.context.fit(chat_history(self.chat.system_prompt, kept), self.chat.settings)

    def drop_last_replies(self) -> list[MessageRecord]:
        """Delete the last turn's replies (an assistant's, tool calls and results too), to generate
        them again; returns them."""
        end = _last_turn_end(self._messages)
        dropped, self._messages = self._messages[end:], self._messages[:end]
        for message in dropped:
            self._store.delete_message(message.id)
        return dropped

    def take_back_last_turn(self) -> list[MessageRecord]:
        """Delete the last user message and everything after it and return them (the first is the
        message, to edit and send again); none while a reply runs or when there is no user message."""
        users = [i for i, m in enumerate(self._messages) if m.role == "user"]
        if self.generating or not users:
            return []
        taken, self._messages = self._messages[users[-1]:], self._messages[:users[-1]]
        for message in taken:
            self._store.delete_message(message.id)
        return taken

    def fork(self, upto: int | None = None) -> tuple[ChatRecord, int]:
        """A new chat with this one's settings and messages up to index `upto` (all: None), the
        results of the tool calls it ends with included; returns it and how many it copied."""
        end = len(self._messages) if upto is None else upto + 1
        while end < len(self._messages) and self._messages[end].role == "tool":
            end += 1
        return self._store.fork_chat(self.chat, self._messages[:end], fork_title(self.chat.title)), end

    def fork_to_edit(self, index: int) -> tuple[ChatRecord, str]:
        """A new chat with the messages before user message `index`, and that message's content (to
        edit there); this chat stays as it was."""
        fork = self._store.fork_chat(self.chat, self._messages[:index], fork_title(self.chat.title))
        return fork, self._messages[index].content

    # the chat's record

    def rename(self, title: str) -> None:
        self.chat = replace(self.chat, title=title)
        self._store.update_chat(self.chat)
        self.on_change(TITLE)

    def update_settings(self, system_prompt: str, settings: ChatSettings) -> None:
        self.chat = replace(self.chat, system_prompt=system_prompt, settings=settings)
        self._store.update_chat(self.chat)
        self.on_change(SETTINGS)

    def toggle(self, setting: str) -> bool:
        """Flip a switch of the chat's settings (`json_mode`, `tools`); returns its new state."""
        settings = replace(self.chat.settings, **{setting: not getattr(self.chat.settings, setting)})
        self.update_settings(self.chat.system_prompt, settings)
        return getattr(settings, setting)


def offered_tools(runner: ToolRunner | None, settings: ChatSettings, engine: EngineClient) -> list[dict[str, Any]]:
    """The tools a chat's next reply is offered: none with tools off in its settings, for a model
    without a chat template, or while no server has tools ready."""
    if runner is None or not settings.tools or not engine.chat_template:
        return []
    return runner.offered()


def _last_turn_end(messages: list[MessageRecord]) -> int:
    """Where the last turn's replies start: after its user message (without one, a last reply)."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if users:
        return users[-1] + 1
    return len(messages) - (bool(messages) and messages[-1].role == "assistant")


def fork_title(title: str) -> str:
    return f"{title.removesuffix(' (fork)')} (fork)"


def _title_from(text: str, limit: int = 28) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
