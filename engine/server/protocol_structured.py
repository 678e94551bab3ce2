"""Request fields for structured outputs and tool calling (mixed into the models of `protocol.py`).

Structured outputs, any one of: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields.
Tools (chat only): `tools`, `tool_choice`, `parallel_tool_calls`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stallfree.engine.server.errors import BadRequest
from stallfree.engine.structured.params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint this request asks for (None: free text); BadRequest naming the field."""
        asked = self._asked()
        if not asked:
            return None
        if len(asked) > 1:
            fields = ", ".join(name for name, _ in asked)
            raise BadRequest(
                f"give one structured output constraint, not several ({fields})", param=asked[1][0]
            )
        param, kwargs = asked[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as e:
            raise BadRequest(f"{param}: {e}", param=param) from e

    def constraint_field(self) -> str:
        """The request field its constraint came from (for error messages)."""
        asked = self._asked()
        return asked[0][0] if asked else "response_format"

    def _asked(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, StructuredOutputsParams arguments) for every constraint the request sets."""
        asked: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise BadRequest(
                    "response_format json_schema needs json_schema.schema", param="response_format"
                )
            js = rf.json_schema
            asked.append(("response_format", {"json": js.json_schema, "strict": js.strict is not False}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = {
                "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                "json_object": so.json_object or None,
            }  # fmt: skip
            asked.append(("structured_outputs", {k: v for k, v in given.items() if v is not None}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                asked.append((name, {key: value}))
        return asked


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ChosenFunction


class ToolFields(BaseModel):
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as plain dicts (what templates and schemas take), without unset fields."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedToolChoice) else tc


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """An assistant message's call in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
