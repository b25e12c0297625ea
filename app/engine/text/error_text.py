"""Exception text shortened for log lines and API error messages."""

from __future__ import annotations


def one_line(e: BaseException) -> str:
    """The first line of `e`'s message, or its type name when the message is empty."""
    # Jinja and numpy errors can run to several lines of context that an API message cannot hold.
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
