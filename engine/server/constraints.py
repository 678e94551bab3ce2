"""From a request body to its constraint and tool plan: the glue between the routes and the engine.

Grammars are compiled here, off the event loop (a large schema takes a while once; then it is cached), so
a bad schema or grammar is a 400 before the request is queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from stallfree.engine.engine import LLMEngine
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.server.errors import BadRequest
from stallfree.engine.server.protocol import ChatCompletionRequest
from stallfree.engine.server.protocol_structured import StructuredFields
from stallfree.engine.server.tool_calls.choice import ToolPlan, plan_tools
from stallfree.engine.server.tool_calls.parsers import ToolParser, resolve_parser
from stallfree.engine.server.tool_calls.prompt import render_chat
from stallfree.engine.server.tool_calls.stream import ToolCallExtractor
from stallfree.engine.structured.params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    token_ids: list[int]
    plan: ToolPlan

    def extractors(self, n: int = 1) -> list[ToolCallExtractor] | None:
        """One reader of the output's tool calls per choice, when the plan has a parser."""
        return None if self.plan.parser is None else [ToolCallExtractor(self.plan.parser) for _ in range(n)]


def chat_prompt(engine: LLMEngine, body: ChatCompletionRequest, tool_call_parser: str) -> ChatPrompt:
    """The chat's prompt ids (tools and tool history included) and its tool plan; BadRequest if invalid."""
    tok = engine.tokenizer
    parser: ToolParser = resolve_parser(tool_call_parser, tok.chat_template)
    try:
        plan = plan_tools(body.tool_dicts(), body.tool_choice_value(), parser, body.parallel_tool_calls)
    except ValueError as e:
        raise BadRequest(str(e), param="tool_choice") from e
    try:
        ids = render_chat(tok, body.conversation(), plan.prompt_tools, parser, body.add_generation_prompt)
    except ValueError as e:
        raise BadRequest(str(e), param="messages") from e
    return ChatPrompt(ids, plan)


def request_constraint(
    body: StructuredFields, plan: ToolPlan | None = None
) -> StructuredOutputsParams | None:
    """The one grammar a request runs under: its own (response_format, guided_*) or its tool choice's."""
    own = body.structured_outputs_params()
    forced = plan.structured_outputs if plan is not None else None
    if own is not None and forced is not None:
        raise BadRequest(
            "tool_choice required or a named function already constrains the output: drop response_format "
            "(or guided_* / structured_outputs), or use tool_choice auto",
            param="tool_choice",
        )
    return own or forced


async def constrain(
    engine: LLMEngine, params: SamplingParams, so: StructuredOutputsParams | None, field: str
) -> SamplingParams:
    """`params` with the constraint, its grammar compiled (cached) in a worker thread; 400 naming `field`
    (the request field the constraint came from) if it cannot be."""
    if so is None:
        return params
    try:
        await asyncio.to_thread(engine.structured.validate, so)
    except ValueError as e:
        raise BadRequest(str(e), param=field) from e
    return replace(params, structured_outputs=so)
