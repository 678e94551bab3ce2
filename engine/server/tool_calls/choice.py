"""tool_choice -> what goes into the prompt, what constrains the output, and how the output is read.

  none      the tools stay out of the prompt and the output is plain content
  auto      the tools go into the prompt; the output is read by the model's parser (hermes, llama3_json)
  required  the grammar engine forces a JSON array of one or more calls of the given tools
  {"type": "function", "function": {"name": F}}   the grammar forces the arguments of F
(as vLLM does: `required` and named choices work whatever the model, `auto` depends on the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stallfree.engine.server.tool_calls.parsers import NamedParser, RequiredParser, ToolParser
from stallfree.engine.structured.params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    prompt_tools: list[dict[str, Any]] | None  # the tools as the template receives them (None: none)
    parser: ToolParser | None  # reads the output; None: plain content
    structured_outputs: StructuredOutputsParams | None  # the grammar for required / named


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parser: ToolParser,
    parallel_tool_calls: bool = True,
) -> ToolPlan:
    """The plan for a request's tools. ValueError (the caller makes it a 400) for a bad combination."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools: give the functions the model may call in `tools`")
        return ToolPlan(None, None, None)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool function names must be unique")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, None, None)
    if choice == "auto":
        return ToolPlan(tools, parser, None)
    if choice == "required":
        schema = required_schema(tools, parallel_tool_calls)
        return ToolPlan(tools, RequiredParser(), StructuredOutputsParams(json=schema))
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})"
            )
        params = _parameters(tools[names.index(name)])
        return ToolPlan(tools, NamedParser(name), StructuredOutputsParams(json=params))
    raise ValueError(f"tool_choice must be none, auto, required or a named function, got {choice!r}")


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """A JSON array of at least one call: {"name": one of the tools, "parameters": its arguments}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT
