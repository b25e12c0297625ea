"""A round of calls: approval asked only where needed, "always" remembered, refusal told to the
model, bad arguments and unknown tools answered, the step limit stops the loop."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from mcp import Client

from app.engine.api.tool_use import ParsedCall
from app.tools.approval import REFUSED_TEXT, ApprovalPolicy, Decision, StepLimit
from app.tools.builtin_server import build_server
from app.tools.guidance import REPEATED_TEXT, cut_call_cause, next_tool_choice
from app.tools.manager import ToolInfo
from app.tools.results import ToolResult
from app.tools.turn import ToolLoop, card_preview, edit_preview
from app.tools.workdir import Workdir

TOOLS = {t.offered_name: t for t in (ToolInfo("files", "read_file", "files__read_file", "", {}, True, True),
                                     ToolInfo("files", "apply_edit", "files__apply_edit", "", {}, True, False))}


class Runner:
    def __init__(self) -> None:
        self.ran: list[tuple[str, dict]] = []

    def find(self, offered: str) -> ToolInfo | None:
        return TOOLS.get(offered)

    async def call_async(self, offered, arguments, timeout=None) -> ToolResult:
        self.ran.append((offered, dict(arguments)))
        return ToolResult(f"ran {offered}")


def call(name: str, **arguments) -> ParsedCall:
    return ParsedCall(f"id_{name}", name, json.dumps(arguments))


async def test_round_of_calls() -> None:
    runner, asked = Runner(), []
    loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(2))

    async def ask(card):
        asked.append(card)
        return Decision.REFUSE if len(asked) == 1 else Decision.ALWAYS

    edit = call("files__apply_edit", path="a.py", search="x = 1\n", replace="x = 2\n")
    out = await loop.run([call("files__read_file", path="a.py"), edit, ParsedCall("bad", "files__read_file", "{nope")],
                         ask)
    assert [m["content"] for m in out] == ["ran files__read_file", REFUSED_TEXT,
                                           "Error: the arguments are not a JSON object"]
    assert out[1] == {"role": "tool", "tool_call_id": "id_files__apply_edit", "content": REFUSED_TEXT,
                      "name": "files__apply_edit"}
    assert [c.title for c in asked] == ["files · apply_edit"]
    assert asked[0].diff == "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    out = await loop.run([edit, edit, call("nope__x")], ask)  # "always" from the second ask on
    assert [m["content"] for m in out] == ["ran files__apply_edit"] * 2 + ["Error: there is no tool named 'nope__x'"]
    assert len(asked) == 2
    assert await loop.run([edit], ask) is None  # the third round in a row: over the step limit of 2
    loop.steps.reset()
    assert await loop.run([], ask) == []


async def test_a_builtin_read_made_again_right_after_itself_is_not_run() -> None:
    """Only the built-in server's reads (their result cannot change without an edit between), and
    only the round just before; a new user message forgets it. Not a failure: no call is forced."""
    builtin = {name: ToolInfo("files", name.split("__")[1], name, "", {}, True, True, root="/w")
               for name in ("files__read_file", "files__search", "files__apply_edit")}
    other = ToolInfo("fx", "status", "fx__status", "", {}, True, True)

    class Tools(Runner):
        def find(self, offered: str) -> ToolInfo | None:
            return builtin.get(offered) or (other if offered == "fx__status" else None)

    runner = Tools()
    loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(20))
    read, search = call("files__read_file", path="a.py"), call("files__search", pattern="x")
    spaced = ParsedCall("id_2", "files__read_file", '{ "path" : "a.py" }')
    assert [m["content"] for m in await loop.run([read], refuse_all)] == ["ran files__read_file"]
    assert [m["content"] for m in await loop.run([spaced], refuse_all)] == [REPEATED_TEXT]
    assert next_tool_choice([{"role": "tool", "content": REPEATED_TEXT}]) == "auto"
    await loop.run([search], refuse_all)
    await loop.run([read], refuse_all)  # not the round just before: runs
    poll = call("fx__status")
    await loop.run([poll], refuse_all)
    await loop.run([poll], refuse_all)  # another server's tool may answer differently each time
    loop.new_turn()
    await loop.run([read], refuse_all)
    await loop.run([read], refuse_all)
    assert [name for name, _ in runner.ran] == ["files__read_file", "files__search", "files__read_file",
                                                "fx__status", "fx__status", "files__read_file"]


def test_edit_preview() -> None:
    assert edit_preview({"diff": "@@ -1 +1 @@\n-a\n+b\n"}) == "@@ -1 +1 @@\n-a\n+b\n"
    assert edit_preview({"path": "x"}) is None


async def test_a_call_cut_by_the_token_limit_is_told_so() -> None:
    """The model reads the cause and the cap, not a JSON error; a cut call whose arguments are
    whole (only `}` and `</tool_call>` missing) runs."""
    runner = Runner()
    loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(4))
    cause = cut_call_cause(256)
    cut = ParsedCall("c1", "files__read_file", '{"path": "a.p')
    out = await loop.run_one(cut, refuse_all, cause)
    assert out["content"] == "Error: the call was cut at the 256-token limit of a reply; write a shorter call"
    assert (await loop.run_one(cut, refuse_all))["content"] == "Error: the arguments are not a JSON object"
    whole = ParsedCall("c2", "files__read_file", '{"path": "a.py"}')
    assert (await loop.run_one(whole, refuse_all, cause))["content"] == "ran files__read_file"
    assert cut_call_cause(None) == "the call was cut at the end of the context"
    # A round: only its last call can be the cut one.
    contents = [m["content"] for m in await loop.run([cut, cut], refuse_all, cause)]
    assert contents == ["Error: the arguments are not a JSON object", out["content"]]


async def refuse_all(card) -> Decision:
    return Decision.REFUSE


LINES = "".join(f"line {i}\n" for i in range(1, 13))  # line 1 ... line 12


def builtin_edit(root: Path) -> ToolInfo:
    return ToolInfo("files", "apply_edit", "files__apply_edit", "", {}, True, False, str(root))


async def test_an_edit_card_shows_the_change_in_the_file_as_the_server_makes_it(tmp_path: Path) -> None:
    """The built-in server's apply_edit: the card's diff is the file's, with 3 lines of context and
    its line numbers, the very diff the server returns when the call runs; where the call would
    fail, the card says why in the server's words and shows the arguments' diff."""
    (tmp_path / "a.py").write_text(LINES)
    (tmp_path / "twice.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    tool = builtin_edit(tmp_path)
    edit = {"path": "a.py", "search": "line 7\n", "replace": "line seven\n"}
    diff, note = await card_preview(tool, edit)
    assert note is None and diff == ("--- a/a.py\n+++ b/a.py\n@@ -4,7 +4,7 @@\n line 4\n line 5\n line 6\n"
                                     "-line 7\n+line seven\n line 8\n line 9\n line 10\n")
    assert (tmp_path / "a.py").read_text() == LINES  # nothing written
    failing = [{"path": "a.py", "search": "line 70\n", "replace": "x\n"},  # not found
               {"path": "twice.py", "search": "x = 1\n", "replace": "x = 2\n"},  # found twice
               {"path": "missing.py", "search": "a", "replace": "b"},
               {"path": "blob.bin", "search": "a", "replace": "b"},
               {"path": "../elsewhere.py", "search": "a", "replace": "b"},
               {"path": "a.py", "search": "line 7\n", "replace": "line 7\n"}]  # changes nothing
    async with Client(build_server(tmp_path)) as client:
        for arguments in failing:
            diff, note = await card_preview(tool, arguments)
            assert diff == edit_preview(arguments) and note is not None and "\n" not in note
            ran = await client.call_tool("apply_edit", arguments)
            assert ran.is_error and ran.content[0].text == f"Error executing tool apply_edit: {note}", arguments
        for arguments in (edit, {"path": "new.py", "search": "", "replace": "print(1)\n"},
                          {"path": "a.py", "diff": "@@ -3,1 +3,1 @@\n-line 2\n+line two\n"}):  # hunk off by one
            diff, note = await card_preview(tool, arguments)
            ran = await client.call_tool("apply_edit", arguments)
            assert note is None and not ran.is_error and ran.content[0].text == diff
            assert diff.startswith("--- /dev/null\n" if arguments["path"] == "new.py" else "--- a/a.py\n")
    assert (tmp_path / "new.py").read_text() == "print(1)\n"  # its card showed it made from /dev/null
    # The diff a model sends is placed by its lines: the card shows where it really applies.
    assert (tmp_path / "a.py").read_text().startswith("line 1\nline two\nline 3\n")


async def test_an_edit_preview_reads_the_file_off_the_calling_thread(tmp_path: Path, monkeypatch) -> None:
    """The loop awaiting the card is the UI's: the file is read on a worker thread."""
    (tmp_path / "a.py").write_text(LINES)
    threads: list[int] = []
    preview = Workdir.preview_edit

    def recording(self, *args):
        threads.append(threading.get_ident())
        return preview(self, *args)

    monkeypatch.setattr(Workdir, "preview_edit", recording)
    runner, cards = Runner(), []
    TOOLS["files__apply_edit_root"] = builtin_edit(tmp_path)
    try:
        async def ask(card):
            cards.append(card)
            return Decision.REFUSE

        loop = ToolLoop(runner, ApprovalPolicy(), StepLimit(2))
        await loop.run_one(call("files__apply_edit_root", path="a.py", search="line 2\n", replace="2\n"), ask)
    finally:
        del TOOLS["files__apply_edit_root"]
    assert threads and threads[0] != threading.get_ident()
    assert cards[0].diff.startswith("--- a/a.py\n+++ b/a.py\n@@ -1,5 +1,5 @@\n line 1\n-line 2\n+2\n")


async def test_another_servers_edit_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(LINES)
    theirs = ToolInfo("git", "apply_edit", "git__apply_edit", "", {}, True, False)
    arguments = {"path": "a.py", "search": "line 7\n", "replace": "line seven\n"}
    assert await card_preview(theirs, arguments) == ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-line 7\n+line seven\n", None)
