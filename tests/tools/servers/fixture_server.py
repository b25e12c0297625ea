"""An MCP server for the tool manager's tests, over stdio or streamable HTTP.

    fixture_server.py ok [--http PORT]   # tools: echo, big, crash, exit_soon, hang, picture
    fixture_server.py silent             # starts and never answers
    fixture_server.py broken             # exits at once with a message on stderr"""

from __future__ import annotations

import base64
import os
import sys
import threading
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ImageContent, TextContent


def build() -> MCPServer:
    server = MCPServer("fixture", log_level="WARNING")

    @server.tool(structured_output=False)
    def echo(text: str, times: int = 1) -> str:
        """Repeat the text."""
        return " ".join([text] * times)

    @server.tool(structured_output=False)
    def big(chars: int) -> str:
        """A result of `chars` characters, in lines of 100."""
        line = "x" * 99 + "\n"
        return (line * (chars // 100 + 1))[:chars]

    @server.tool(structured_output=False)
    def crash() -> str:
        """The server process dies during the call."""
        os._exit(3)

    @server.tool(structured_output=False)
    def exit_soon() -> str:
        """Answers, then the server process dies while idle."""
        threading.Timer(0.3, os._exit, (4,)).start()
        return "bye"

    @server.tool(structured_output=False)
    def hang() -> str:
        """Never answers."""
        time.sleep(3600)
        return "late"

    @server.tool(structured_output=False)
    def picture() -> list:
        """An image and a caption."""
        return [TextContent(type="text", text="a red dot"),
                ImageContent(type="image", data=base64.b64encode(b"\x89PNG" + bytes(896)).decode(), mime_type="image/png")]

    @server.prompt()
    def review(path: str) -> str:
        """Review a file."""
        return f"Please review {path} for bugs."

    return server


def main() -> None:
    mode = sys.argv[1]
    if mode == "silent":
        time.sleep(3600)
    elif mode == "broken":
        print("fixture: cannot open the database", file=sys.stderr)
        sys.exit(2)
    elif "--http" in sys.argv:
        build().run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        build().run("stdio")


if __name__ == "__main__":
    main()
