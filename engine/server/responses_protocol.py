"""The /v1/responses request body (the trust boundary) and its translation into a chat completion request.

A Responses request runs as the chat request it amounts to: `instructions` become the system message,
`input` items (messages, function_call, function_call_output) the conversation after the stored one of
`previous_response_id`, function `tools` / `tool_choice` the chat's, `text.format` its response_format and
`max_output_tokens` its max_completion_tokens. So prompt building, tool parsing, structured outputs,
admission and metrics are the chat endpoint's, not a copy.

What cannot be honoured is refused with a 400 naming it: built-in tools (web_search, file_search,
code_interpreter, ...), `background`, reasoning items and `reasoning` (the served model has no reasoning
mode), conversations, prompt templates, and the rest of RESPONSES_REFUSED.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stallfree.engine.server.errors import BadRequest
from stallfree.engine.server.protocol import ChatCompletionRequest
from stallfree.engine.server.request_fields import REFUSED_FIELDS, refuse_unsupported

RESPONSES_REFUSED: dict[str, str] = {
    "background": "background responses are not supported: send the request and read the answer "
    "(stream: true shows it as it is generated)",
    "reasoning": "reasoning is not supported: the served model has no reasoning mode",
    "conversation": "conversations are not supported: continue a conversation with previous_response_id",
    "prompt": "prompt templates (prompt) are not supported: send the input itself",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; /v1/chat/completions returns logprobs",
    "truncation": "truncation auto is not supported: a prompt beyond the context length is a 400",
    "context_management": "context_management is not supported",
}
# Chat sampling fields (OpenAI's and vLLM's) a Responses request may also send: they go to the chat request.
SAMPLING_EXTRAS = ("seed", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens")  # fmt: skip
# include entries that change nothing here: the model produces no reasoning to include.
INERT_INCLUDES = frozenset({"reasoning.encrypted_content"})
ITEM_TYPES = "messages, function_call and function_call_output"


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    # Undeclared fields land in model_extra: refused when in RESPONSES_REFUSED (or the chat's REFUSED_FIELDS).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check_unsupported(self) -> None:
        """400 naming the first field, tool, include entry or text option this server cannot honour."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in SAMPLING_EXTRAS}
        refuse_unsupported(extra, {**REFUSED_FIELDS, **RESPONSES_REFUSED})
        includes = [i for i in self.include or () if i not in INERT_INCLUDES]
        if includes:
            raise BadRequest(f"include {includes} is not supported", param="include")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise BadRequest("text.verbosity is not supported (only medium)", param="text.verbosity")
        self.chat_tools()
        self.chat_tool_choice()

    # ---- input -> chat messages ---------------------------------------------------------------------
    def conversation(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (instructions not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input, "input")

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one amounts to, over `conversation` (stored history + this input)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += conversation
        if not messages:
            raise BadRequest("input is empty: give a string or at least one item", param="input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream,
            **{k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_EXTRAS},
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise BadRequest(f"input: {where}: {err['msg']}", param="input") from e

    # ---- tools and format -----------------------------------------------------------------------------
    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Function tools in the chat shape; 400 for a built-in tool or a bad function."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise BadRequest(
                    f"tools[{i}]: the built-in tool {kind!r} is not supported; this server runs function "
                    "tools (type: function) only",
                    param=f"tools[{i}]",
                )
            try:
                fn = FunctionTool.model_validate(tool)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise BadRequest(f"tools[{i}].{where}: {err['msg']}", param=f"tools[{i}].{where}") from e
            out.append({"type": "function", "function": fn.model_dump(exclude={"type"}, exclude_none=True)})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        tc = self.tool_choice
        if not isinstance(tc, dict):
            return tc
        if tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise BadRequest(
            f"tool_choice {tc!r} is not supported: give none, auto, required or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
        )

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.json_schema is None:
            raise BadRequest("text.format json_schema needs a schema", param="text.format")
        js = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": js}

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": self.tool_choice or "auto",
            "tools": self.tools or [],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled",
            "background": False,
            "store": self.store,
            "metadata": self.metadata or {},
            "user": self.user,
        }


def items_to_messages(items: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Responses items (input, or a stored response's output) as chat messages; 400 for what we do not take.

    Consecutive function_call items join one assistant message's tool_calls (with the text before them)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"{param}[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}: role must be user, assistant, system or developer", param=where)
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call_output needs its call_id", param=where)
            output = _text(item.get("output"), where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            raise BadRequest(
                f"{where}: reasoning items are not supported: the served model does not reason; drop them",
                param=where,
            )
        elif kind == "item_reference":
            raise BadRequest(
                f"{where}: item references are not supported: send the items themselves, or continue a "
                "stored response with previous_response_id",
                param=where,
            )
        else:
            raise BadRequest(
                f"{where}: items of type {kind!r} are not supported; send {ITEM_TYPES}", param=where
            )
    return messages


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
        raise BadRequest(
            f"{where}: a function_call needs name, call_id and arguments (a JSON string)", param=where
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text, refusal)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of parts", param=where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(
                f"{where}: content parts of type {kind!r} are not supported: this server takes text only",
                param=where,
            )
    return "".join(texts)
