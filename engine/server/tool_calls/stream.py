"""Tool calls in responses: the whole message, or streamed deltas in the shape OpenAI sends them.

A streamed call starts with one delta holding its index, id, type and the function's name (arguments "")
and continues with deltas holding pieces of the arguments' JSON text; the pieces concatenate to the
arguments of the whole response. The last chunk's finish_reason is "tool_calls" when calls were made.
"""

from __future__ import annotations

import uuid
from typing import Any

from stallfree.engine.server.tool_calls.parsers import Parsed, ToolParser
from stallfree.engine.server.tool_calls.scan import Malformed


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallExtractor:
    """Reads one request's output with a parser; feed it the text as it grows (streaming) or read it whole."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    # ---- whole response ----------------------------------------------------------------------------
    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output; content None when it is only calls."""
        parsed = self.parser.parse_final(text)
        calls = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
        content = parsed.content
        if calls and not content.strip():
            return None, calls
        return content, calls

    # ---- streaming -----------------------------------------------------------------------------------
    @property
    def made_calls(self) -> bool:
        return bool(self._ids)

    def feed(self, new_text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas (`{"content": ...}` or `{"tool_calls": [...]}`) that `new_text` completes."""
        self.text += new_text
        parsed = self.parser.parse_final(self.text) if final else self._parse_so_far()
        deltas: list[dict[str, Any]] = []
        if len(parsed.content) > self._content_sent:
            deltas.append({"content": parsed.content[self._content_sent :]})
            self._content_sent = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self._ids):
                self._ids.append(call_id())
                self._args_sent.append(0)
                head = {"index": index, "id": self._ids[index], "type": "function"}
                deltas.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._args_sent[index]:
                piece = call.arguments[self._args_sent[index] :]
                self._args_sent[index] = len(call.arguments)
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas

    def _parse_so_far(self) -> Parsed:
        try:
            return self.parser.parse(self.text, final=False)
        except Malformed:  # not a call after all: all of it is content
            return Parsed(self.text)
