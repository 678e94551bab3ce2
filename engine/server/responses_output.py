"""Response objects and streaming events of /v1/responses, built as plain dicts (one event per streamed
token: keep it cheap). Shapes follow the openai SDK's `openai.types.responses`.

A stream goes: response.created, response.in_progress; per output item response.output_item.added, then
for a message response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, and for a function call response.function_call_arguments.delta...,
response.function_call_arguments.done; then response.output_item.done; last response.completed (or
response.incomplete when max_output_tokens cut it, response.failed when the engine or the server failed).
Every event carries a sequence_number, counted from 0.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from stallfree.engine.outputs import RequestOutput
from stallfree.engine.server.tool_calls.stream import ToolCallExtractor


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(out: RequestOutput) -> dict[str, Any]:
    n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_in + n_out,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


class ResponseWriter:
    """One response's body (whole) or events (streamed). `echo`: the request's settings, repeated in the
    Response object; `extractor`: the reader of tool calls when the request has tools."""

    def __init__(
        self, response_id: str, model: str, echo: dict[str, Any], extractor: ToolCallExtractor | None
    ) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.extractor = extractor
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items; the last may still be open
        self.final: dict[str, Any] | None = None  # the finished Response object
        self._open = False  # the last item is still being generated
        self._text: list[str] = []  # pieces of the open message's text
        self._seq = 0

    def response(self, status: str, out: RequestOutput | None = None, **fields: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": self.items, "error": None, "incomplete_details": None,
                "usage": usage(out) if out is not None else None, **self.echo, **fields}  # fmt: skip
        if status in ("completed", "incomplete", "failed"):
            body["completed_at"] = int(time.time())
        return body

    # ---- whole ------------------------------------------------------------------------------------
    def whole(self, out: RequestOutput) -> dict[str, Any]:
        """The finished Response of a request's final output."""
        content, calls = (out.text, []) if self.extractor is None else self.extractor.message(out.text)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        if content is not None or not calls:
            self.items.append(message_item(_id("msg"), content or "", status))
        for c in calls:
            fn = c["function"]
            self.items.append(call_item(_id("fc"), c["id"], fn["name"], fn["arguments"], "completed"))
        return self._finish(out)

    def _finish(self, out: RequestOutput) -> dict[str, Any]:
        if out.finish_reason == "length":
            self.final = self.response("incomplete", out, incomplete_details={"reason": "max_output_tokens"})
        else:
            self.final = self.response("completed", out)
        return self.final

    # ---- streaming ----------------------------------------------------------------------------------
    def _event(self, kind: str, body: dict[str, Any]) -> str:
        body["type"] = kind
        body["sequence_number"] = self._seq
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> str:
        return self._event("response.created", {"response": self.response("in_progress")}) + self._event(
            "response.in_progress", {"response": self.response("in_progress")}
        )

    def feed(self, out: RequestOutput) -> str:
        """The events of one engine output: its new text (or tool-call pieces), and the end when it ends."""
        if self.extractor is None:
            events = self._text_delta(out.new_text) if out.new_text else ""
        else:
            events = "".join(self._tool_delta(d) for d in self.extractor.feed(out.new_text, out.finished))
        if not out.finished:
            return events
        if not self.items:  # nothing was generated: the response still holds its (empty) message
            events += self._open_message()
        status = "incomplete" if out.finish_reason == "length" else "completed"
        events += self._close(status)
        body = self._finish(out)
        return events + self._event(f"response.{body['status']}", {"response": body})

    def failed(self, message: str) -> str:
        """The stream's end when the engine or the server failed: response.failed with the error."""
        events = ""
        try:
            events = self._close("incomplete")
        except Exception:  # noqa: BLE001, S110 - the failure itself is what the client must hear
            pass
        self.final = self.response("failed", error={"code": "server_error", "message": message})
        return events + self._event("response.failed", {"response": self.final})

    def _text_delta(self, text: str) -> str:
        events = "" if self._open and self.items[-1]["type"] == "message" else self._open_message()
        self._text.append(text)
        item_id = self.items[-1]["id"]
        return events + self._event("response.output_text.delta", {"item_id": item_id,
            "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": []})  # fmt: skip

    def _tool_delta(self, delta: dict[str, Any]) -> str:
        """One of the chat extractor's deltas as Responses events."""
        if "content" in delta:
            return self._text_delta(delta["content"])
        call = delta["tool_calls"][0]
        if "id" in call:  # a new call: its name comes first, the arguments follow in pieces
            events = self._close("completed")
            self.items.append(call_item(_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
            self._open = True
            item = {**self.items[-1]}
            return events + self._event("response.output_item.added",
                                        {"output_index": len(self.items) - 1, "item": item})  # fmt: skip
        item = self.items[-1]
        piece = call["function"]["arguments"]
        item["arguments"] += piece
        return self._event("response.function_call_arguments.delta",
                           {"item_id": item["id"], "output_index": len(self.items) - 1, "delta": piece})  # fmt: skip

    def _open_message(self) -> str:
        events = self._close("completed")
        item_id = _id("msg")
        self.items.append({"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
                           "content": []})  # fmt: skip
        self._open, self._text = True, []
        index = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += self._event(
            "response.output_item.added", {"output_index": index, "item": {**self.items[-1]}}
        )
        return events + self._event("response.content_part.added",
                                    {"item_id": item_id, "output_index": index, "content_index": 0, "part": part})  # fmt: skip

    def _close(self, status: str) -> str:
        """Events that end the open item, which becomes final with `status`."""
        if not self._open:
            return ""
        self._open = False
        index, item = len(self.items) - 1, self.items[-1]
        head = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = "".join(self._text)
            done = message_item(item["id"], text, status)
            self.items[-1] = done
            part = done["content"][0]
            events = self._event("response.output_text.done", {**head, "content_index": 0, "text": text,
                                                               "logprobs": []})  # fmt: skip
            events += self._event("response.content_part.done", {**head, "content_index": 0, "part": part})
        else:
            item["status"] = status
            events = self._event("response.function_call_arguments.done",
                                 {**head, "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
        return events + self._event(
            "response.output_item.done", {"output_index": index, "item": self.items[-1]}
        )
