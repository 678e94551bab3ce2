"""Put the tools and the tool-call history into the prompt, through the model's own chat template.

As vLLM does, `tools` is passed to the template as a variable and assistant `tool_calls` / `tool` messages
are passed as they are (arguments as objects, which is what templates expect). A template that ignores
`tools` (SmolLM2's, for one) gets the default tool prompt instead: a system message listing the functions
as JSON schemas and saying how to call them in the chosen parser's format; a template that knows nothing
of `tool_calls` sees them written out in that format, and tool results wrapped in <tool_response> tags.
"""

from __future__ import annotations

import json
from typing import Any

from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.server.tool_calls.parsers import ToolParser

DEFAULT_TOOL_PROMPT = """You are a helpful assistant that can call functions. The functions you may call, as JSON schemas:
<tools>
{tools}
</tools>
{instructions}"""


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parser: ToolParser,
    add_generation_prompt: bool,
) -> list[int]:
    """Prompt token ids of a conversation with optional tools. ValueError if the template rejects it."""
    template = tokenizer.chat_template or ""
    if "tool_calls" in template:
        messages = [_native(m) for m in messages]
    else:
        messages = [_written_out(m, parser) for m in messages]
    if not tools:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    with_tools = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if with_tools == without:  # the template ignores `tools`
        with_tools = tokenizer.apply_chat_template(
            with_tool_prompt(messages, tools, parser), add_generation_prompt=add_generation_prompt
        )
    return tokenizer.encode(with_tools, add_special_tokens=False)


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: ToolParser
) -> list[dict[str, Any]]:
    """The conversation with the default tool prompt in (or as) its system message."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = DEFAULT_TOOL_PROMPT.format(tools=listing, instructions=parser.instructions())
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _native(m: dict[str, Any]) -> dict[str, Any]:
    """For templates that render tool calls: arguments as objects (templates apply `tojson` to them)."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c["function"])
        try:
            fn["arguments"] = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            pass  # a template that can take a string gets the string
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}


def _written_out(m: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    """For templates that know only role and content: calls written in the parser's format."""
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if not m.get("tool_calls"):
        return {"role": m["role"], "content": m["content"]}
    calls = parser.format_calls([c["function"] for c in m["tool_calls"]])
    content = f"{m['content']}\n{calls}" if m["content"] else calls
    return {"role": m["role"], "content": content}
