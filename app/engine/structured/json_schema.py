"""JSON-schema policies applied before xgrammar compiles a schema.

Whitespace: JSON allows any amount between tokens, and a small model under an unbounded rule can
spend its whole budget on newlines. Runs are capped at `JSON_MAX_WHITESPACE` characters: room for
pretty-printing a few levels deep. Structural tags get the same cap on their JSON contents.

Bounded strings: xgrammar 0.2.8 compiles a string with `minLength` / `maxLength` to a bounded repeat of a character
class that admits raw control characters (tab, U+0001...) and no escapes (xgrammar issue #800),
so a small model can emit a string that strict JSON parsers reject. The same bounds written as a
`pattern` go through its JSON-string-aware regex path, whose `.` is one code point that needs no
escape: control characters, `"` and `\\` are then excluded and the length counts code points as
JSON Schema does. Remove this module when xgrammar ships the fix.
"""

from __future__ import annotations

from typing import Any

JSON_MAX_WHITESPACE = 24
# Keywords whose values are data, not subschemas: a rewrite there would change what is allowed.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# A string with any of these is compiled by another path, which the bug does not touch.
_OTHER_STRING_PATHS = ("pattern", "format", "enum", "const")


def bounded_strings_as_patterns(node: Any) -> Any:
    """A copy of `node` (a schema, or a structural tag holding schemas) with every length-bounded
    plain string rewritten as the equivalent pattern."""
    if isinstance(node, list):
        return [bounded_strings_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: v if k in _DATA_KEYWORDS else bounded_strings_as_patterns(v) for k, v in node.items()}
    return _as_pattern(node) if _is_bounded_plain_string(node) else node


def cap_tag_whitespace(node: Any) -> Any:
    """A copy of a structural tag whose JSON-schema contents get `JSON_MAX_WHITESPACE` unless
    they set their own `max_whitespace_cnt`."""
    if isinstance(node, list):
        return [cap_tag_whitespace(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {"max_whitespace_cnt": JSON_MAX_WHITESPACE, **node}
    return {k: cap_tag_whitespace(v) for k, v in node.items()}


def _is_bounded_plain_string(node: dict[str, Any]) -> bool:
    if node.get("type") != "string" or any(k in node for k in _OTHER_STRING_PATHS):
        return False
    bounds = [node[k] for k in ("minLength", "maxLength") if k in node]
    # Malformed bounds are left for xgrammar to report.
    return bool(bounds) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bounds)


def _as_pattern(node: dict[str, Any]) -> dict[str, Any]:
    low, high = node.get("minLength", 0), node.get("maxLength", "")
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    return {**rest, "pattern": f"^.{{{low},{high}}}$"}
