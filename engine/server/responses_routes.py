"""/v1/responses: create (whole or streamed), read back and delete stored responses.

A request becomes the chat request it amounts to (responses_protocol.py) and runs on the chat endpoint's
path: prepare_chat (chat template, tools, constraint), admit (traffic cluster, 429), the same engine and
metrics. Only the output's shape differs (responses_output.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from stallfree.engine.server.async_engine import RequestStream
from stallfree.engine.server.errors import BadRequest
from stallfree.engine.server.openai_routes import (
    admit,
    collect_whole,
    event_stream,
    get_state,
    prepare_chat,
    require_api_key,
)
from stallfree.engine.server.responses_output import ResponseWriter
from stallfree.engine.server.responses_protocol import ResponsesRequest, items_to_messages

logger = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(require_api_key)])

# The chat request's fields as a Responses request names them, for the 400s of the shared path.
PARAM_NAMES = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = get_state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    body.check_unsupported()
    history = []
    if body.previous_response_id is not None:
        history = state.responses.get(body.previous_response_id, "previous_response_id").conversation
    conversation = history + body.conversation()
    chat = body.to_chat(conversation)
    try:
        chat.check_unsupported(engine.engine.model_config.vocab_size)
        prepared = await prepare_chat(
            state, engine, chat, prompt_param="input", max_tokens_param="max_output_tokens"
        )
    except BadRequest as e:
        e.param = PARAM_NAMES.get(e.param or "", e.param)
        raise
    response_id = f"resp_{uuid.uuid4().hex}"
    rs = admit(state, engine, request, response_id, prepared.token_ids, prepared.params, prompt_param="input")
    extractor = prepared.extractors[0] if prepared.extractors else None
    writer = ResponseWriter(response_id, state.model_name or "", body.echo(), extractor)

    def keep(final: dict[str, Any]) -> None:
        if body.store:
            state.responses.put(final, conversation + items_to_messages(final["output"], "output"))

    if body.stream:
        return event_stream(engine, rs, lambda release: _events(rs, writer, keep, release))
    outs = await collect_whole(engine, rs, request)
    if outs is None:  # the client went away; nobody reads this
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    final = writer.whole(outs[0])
    keep(final)
    return JSONResponse(final)


async def _events(
    rs: RequestStream,
    writer: ResponseWriter,
    keep: Callable[[dict[str, Any]], None],
    release: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """The response's events. NOTE: a stream never ends silently: when the engine fails the request, or
    building an event raises, the last event is response.failed with the error (the SDK's stream helper then
    has no completed response and raises; raw iterators see the failed event)."""
    try:
        try:
            yield writer.start()
            async for out in rs:
                if out.finish_reason == "error":
                    yield writer.failed(out.error or "the engine failed this request")
                    break
                events = writer.feed(out)
                if events:
                    yield events
        except Exception as e:  # noqa: BLE001 - the client must hear about it, not see a short answer
            logger.exception("stream of %s failed", rs.request_id)
            yield writer.failed(f"the server failed while streaming: {type(e).__name__}: {e}")
        if writer.final is not None:
            keep(writer.final)
    finally:
        await release()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False):
    if stream:
        raise BadRequest("streaming a stored response again is not supported: read it whole", param="stream")
    return JSONResponse(get_state(request).responses.get(response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    get_state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
