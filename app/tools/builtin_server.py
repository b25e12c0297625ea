"""`localbatch mcp`: the built-in code tools as a stdio MCP server for one working directory,
usable by the app and by any MCP client. The tools are `Workdir`'s; a refused call comes back
as a tool error of one line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from app.tools import workdir as wd
from app.tools.errors import ToolInputError, refusal_line
from app.tools.workdir import Workdir

SERVER_NAME = "localbatch"
INSTRUCTIONS = ("Tools over one working directory: list_files, read_file, search (regular expressions) and "
                "apply_edit. Paths are relative to the working directory.")

# The tools' descriptions the model reads (one line each; the others are their docstrings).
LIST_FILES = ("List the files of the working directory (or a directory in it), skipping what .gitignore ignores; "
              "for a file, list its functions and classes.")
SEARCH = ("Search the files for lines matching a regular expression; prints file:line: text, and file=line= text "
          "for the function or class that holds a match.")

_T = TypeVar("_T")


def _refusal(call: Callable[[], _T]) -> _T:
    try:
        return call()
    except (ToolInputError, OSError) as e:
        raise ToolError(refusal_line(e)) from None


def build_server(root: str | Path) -> MCPServer[Any]:
    """The server for `root` (raises `ToolInputError` when it is not a directory)."""
    work = Workdir.open(root)
    server: MCPServer[Any] = MCPServer(SERVER_NAME, instructions=INSTRUCTIONS, log_level="WARNING")

    @server.tool(structured_output=False, description=LIST_FILES)
    def list_files(
        path: Annotated[str, Field(description="directory (or file) relative to the working directory")] = ".",
        pattern: Annotated[str | None, Field(description="glob on the path or file name, e.g. '*.py'")] = None,
        limit: Annotated[int, Field(description=f"most files listed (at most {wd.MAX_LIST})", ge=1,
                                    le=wd.MAX_LIST)] = wd.DEFAULT_LIST,
    ) -> str:
        return _refusal(lambda: work.list_files(path, pattern, limit))

    @server.tool(structured_output=False)
    def read_file(
        path: Annotated[str, Field(description="file relative to the working directory")],
        start_line: Annotated[int, Field(description="first line, from 1", ge=1)] = 1,
        end_line: Annotated[int | None, Field(description="last line (inclusive); default: the end", ge=1)] = None,
    ) -> str:
        """Read a text file, or a range of its lines (at most 2000 lines or 100 kB per call)."""
        return _refusal(lambda: work.read_file(path, start_line, end_line))

    @server.tool(structured_output=False, description=SEARCH)
    def search(
        pattern: Annotated[str, Field(description="Python regular expression, matched per line")],
        path: Annotated[str, Field(description="file or directory to search in")] = ".",
        glob: Annotated[str | None, Field(description="only files matching this glob, e.g. '*.py'")] = None,
        context: Annotated[int, Field(description="lines of context around each match", ge=0,
                                      le=wd.MAX_CONTEXT)] = 2,
        max_matches: Annotated[int, Field(description="stop after this many matches", ge=1,
                                          le=wd.MAX_MATCHES)] = wd.DEFAULT_MATCHES,
        ignore_case: bool = False,
    ) -> str:
        return _refusal(lambda: work.search(pattern, path, glob, context, max_matches, ignore_case))

    @server.tool(structured_output=False)
    def apply_edit(
        path: Annotated[str, Field(description="file relative to the working directory")],
        search: Annotated[str | None, Field(description="exact text to replace; it must occur once "
                                                        "(empty, on a missing file: create it)")] = None,
        replace: Annotated[str | None, Field(description="the text that replaces it")] = None,
        diff: Annotated[str | None, Field(description="instead of search/replace: a unified diff of this file")] = None,
    ) -> str:
        """Edit one text file by search/replace or by a unified diff; returns the diff applied."""
        return _refusal(lambda: work.apply_edit(path, search, replace, diff))

    # The SDK keeps the schema it derived from the signature on its tool (mcp 2.x, guarded by a test).
    edit = server._tool_manager.get_tool("apply_edit")
    edit.parameters = edit_forms(edit.parameters)
    return server


def edit_forms(schema: dict[str, Any]) -> dict[str, Any]:
    """apply_edit's arguments as its two forms, path + search + replace or path + diff. The
    signature can only say that all but path are optional; a call constraint held to this
    schema writes one form, never both, nor a search without its replace."""
    fields = schema["properties"]

    def form(*keys: str) -> dict[str, Any]:
        properties = {k: {"type": "string", "description": fields[k]["description"]} for k in ("path", *keys)}
        return {"type": "object", "properties": properties, "required": ["path", *keys],
                "additionalProperties": False}

    return {"type": "object", "anyOf": [form("search", "replace"), form("diff")]}


def run_stdio(root: str | Path) -> None:
    """Serve `root` on stdin/stdout until the client closes the pipe."""
    server = build_server(root)
    logging.getLogger("mcp").setLevel(logging.WARNING)
    server.run("stdio")
