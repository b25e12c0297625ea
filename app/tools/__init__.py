"""Tools for the chat: MCP servers (the built-in `localbatch mcp` and configured ones), the calls
a model makes to them, their approval and their results as chat messages. Nothing here imports
Textual: the UI drives these objects."""
