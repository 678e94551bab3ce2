"""Tool-call formats: how a model writes its calls, how we read them back, and how history shows them.

Each parser reads the text generated so far (`final` when it is all there) and returns the content a
client may already see plus the calls so far. Content that might still turn into a call is held back.
  hermes       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
  llama3_json  Llama 3.1 JSON: {"name": ..., "parameters": {...}} (after an optional <|python_tag|>),
               several separated by ";"
Two more read the outputs we force with the grammar engine: `named` (the text is the arguments of a
function chosen by tool_choice) and `required` (a JSON array of {"name", "parameters"} objects).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stallfree.engine.server.tool_calls.scan import Malformed, PartialCall, scan_call, skip_ws


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """Base: a format's name, the instructions for templates that do not render tools, and its reader."""

    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def parse_final(self, text: str) -> Parsed:
        """The finished output: when it is not valid calls after all, it is all content."""
        try:
            parsed = self.parse(text, final=True)
        except Malformed:
            return Parsed(text)
        if any(not c.complete for c in parsed.calls):
            return Parsed(text)
        return parsed

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        """Calls from the history ({"name", "arguments"} with arguments as JSON text), as the model writes them."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call a function, for the default tool prompt."""
        raise NotImplementedError


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_json(call: dict[str, Any], key: str) -> str:
    args = call.get("arguments") or "{}"
    return '{"name": ' + json.dumps(call["name"], ensure_ascii=False) + f', "{key}": ' + args + "}"


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            k = text.find(self.OPEN, pos)
            if k < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - _held(tail, self.OPEN)])
                break
            content.append(text[pos:k])
            j = skip_ws(text, k + len(self.OPEN))
            if j >= len(text):
                calls.append(PartialCall())
                break
            if text[j] != "{":
                raise Malformed("a <tool_call> block must hold a JSON object")
            call, end = scan_call(text, j)
            calls.append(call)
            close = -1 if end is None else text.find(self.CLOSE, end)
            if close < 0:
                break
            pos = close + len(self.CLOSE)
        return Parsed("".join(content), calls)

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{_call_json(c, 'arguments')}\n{self.CLOSE}" for c in calls)

    def instructions(self) -> str:
        return (
            "To call a function, reply with one block per call, each holding a JSON object with the "
            f"function's name and arguments:\n{self.OPEN}\n"
            '{"name": "<function-name>", "arguments": <arguments-json-object>}\n'
            f"{self.CLOSE}"
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[i:]):
            return Parsed("")  # nothing but (the start of) the tag so far
        if i >= len(text):
            return Parsed(text if final else "")
        if text[i] != "{":
            return Parsed(text)
        calls: list[PartialCall] = []
        while i < len(text):
            call, end = scan_call(text, i)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] in ";,":
                i = skip_ws(text, i + 1)
            if i < len(text) and text[i] != "{":
                raise Malformed("text after a Llama 3 JSON tool call")
        return Parsed("", calls)

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_call_json(c, "parameters") for c in calls)

    def instructions(self) -> str:
        return (
            "To call a function, reply with nothing but a JSON object of this form (several calls: "
            'separate them with "; "):\n{"name": "<function-name>", "parameters": <arguments-json-object>}'
        )


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar forces a JSON array of {"name", "parameters"} objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("")
        if text[i] != "[":
            raise Malformed("expected a JSON array of tool calls")
        calls: list[PartialCall] = []
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] != "]":
            if text[i] != "{":
                raise Malformed("expected a tool call object")
            call, end = scan_call(text, i)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return Parsed("", calls)


class NamedParser(ToolParser):
    """tool_choice names a function: the grammar forces the text to be its arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        args = text.strip()
        return Parsed("", [PartialCall(self.function, args, complete=final)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def resolve_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name` stands for; `auto` picks it from the chat template (hermes when it has no tools)."""
    if name == "auto":
        template = chat_template or ""
        if Llama3JsonParser.PYTHON_TAG in template or "ipython" in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose auto or one of {', '.join(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[name]()
