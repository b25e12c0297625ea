"""A chat as a model without a screen (no Textual, no Rich): `session.ChatSession` and its parts,
`draft` (the next message's files), `context_fit` (token counts and the overflow policy),
`history` (what the model reads, and the request) and `reply` (one reply streamed and committed).
The tab in `app/ui/chat.py` is a view of a `ChatSession`."""
