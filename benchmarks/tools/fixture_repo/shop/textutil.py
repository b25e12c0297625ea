"""Text helpers."""

import re


def slugify(text):
    text = text.strip().lower()
    text = re.sub(r"[^a-z0-9]+", "-", text)
    return text.strip("-")


def truncate(text, width):
    """`text` cut to at most `width` characters, ending in '...' when cut."""
    if len(text) <= width:
        return text
    return text[:width] + "..."


def word_count(text):
    return len(text.split(" "))
