"""A forgiving scanner for JSON that is still being generated: where does a value end, if it has yet.

Tool calls arrive token by token; a streaming client wants the function's name as soon as it is complete
and the arguments as they grow. These helpers find the end of a complete JSON value, or say it is not
complete yet, without parsing (and without failing on) the unfinished part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"


class Malformed(ValueError):
    """The text cannot become the JSON we expect, whatever comes next."""


@dataclass(slots=True)
class PartialCall:
    """One tool call as far as it has been generated."""

    name: str | None = None
    arguments: str = ""  # the arguments' JSON text so far (a prefix of the final text)
    complete: bool = False


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index after the closing quote, or None if the string is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None if it is not complete yet."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    # a number or a literal: it ends where a delimiter starts
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int) -> tuple[PartialCall, int | None]:
    """Scan `{"name": ..., "arguments" | "parameters": {...}}` starting at text[i] == '{'.

    Returns the call so far and the index after its closing brace (None while it is still open).
    Raises Malformed when the text cannot be such an object.
    """
    call = PartialCall()
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return call, None
        c = text[j]
        if c == "}":
            if call.name is None:
                raise Malformed("a tool call without a name")
            call.complete = True
            return call, j + 1
        if c == ",":
            j += 1
            continue
        if c != '"':
            raise Malformed(f"unexpected {c!r} in a tool call object")
        key_end = string_end(text, j)
        if key_end is None:
            return call, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return call, None
        if text[j] != ":":
            raise Malformed(f"expected ':' after {key!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return call, None
        end = value_end(text, j)
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(text[j:end])
            if not isinstance(name, str) or not name:
                raise Malformed("a tool call's name must be a non-empty string")
            call.name = name
        elif key in ("arguments", "parameters"):
            if end is None:
                if text[j] in "{[":
                    call.arguments = text[j:].rstrip(WHITESPACE)
                return call, None
            call.arguments = _arguments(text[j:end])
        elif end is None:
            return call, None
        j = end


def _arguments(raw: str) -> str:
    """Arguments as JSON text; some models write them as a JSON string holding the JSON."""
    if raw.startswith('"'):
        inner = json.loads(raw)
        try:
            json.loads(inner)
        except json.JSONDecodeError as e:
            raise Malformed("tool call arguments are a string that is not JSON") from e
        return inner
    if not raw.startswith("{"):
        raise Malformed("tool call arguments must be a JSON object")
    return raw
