"""/v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from stallfree.engine.outputs import RequestOutput
from stallfree.engine.server.async_engine import AsyncEngine, RequestStream
from stallfree.engine.server.constraints import chat_prompt, constrain, request_constraint
from stallfree.engine.server.errors import APIError, BadRequest, ContextLengthExceeded, EngineError
from stallfree.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.engine.server.responses import SSE_DONE, ResponseBuilder, sse
from stallfree.engine.server.state import ServerState

logger = logging.getLogger(__name__)

TRAFFIC_HEADER = "x-traffic-cluster"
DISCONNECT_POLL_S = 0.25
MAX_RETRY_AFTER_S = 60


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def require_api_key(request: Request, authorization: str | None = Header(default=None)) -> None:
    get_state(request).check_api_key(authorization)


router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = get_state(request)
    engine = state.ready_engine()
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "stallfree",
                "max_model_len": engine.engine.max_model_len,
            }
        ],
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = get_state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    body.check_unsupported()
    prompt = body.single_prompt()
    tok = engine.engine.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = _max_tokens(engine, len(ids), body.max_tokens, "prompt")
    params = body.sampling_params(max_tokens, body.logprobs)
    params = await constrain(engine.engine, params, request_constraint(body), body.constraint_field())
    return await _serve(state, engine, request, "completion", ids, params, body.include_usage, body.stream)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    body.check_unsupported()
    prompt = chat_prompt(engine.engine, body, state.settings.tool_call_parser)
    ids = prompt.token_ids
    max_tokens = _max_tokens(engine, len(ids), body.requested_max_tokens(), "messages")
    params = body.sampling_params(max_tokens, body.num_logprobs())
    so = request_constraint(body, prompt.plan)
    field = "tools" if so is not None and so is prompt.plan.structured_outputs else body.constraint_field()
    params = await constrain(engine.engine, params, so, field)
    return await _serve(
        state, engine, request, "chat", ids, params, body.include_usage, body.stream, prompt.extractor()
    )


def _max_tokens(engine: AsyncEngine, n_prompt: int, requested: int | None, param: str) -> int:
    limit = engine.engine.max_model_len
    if n_prompt >= limit:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
            "tokens: shorten it",
            param=param,
        )
    if requested is None:
        return limit - n_prompt
    if n_prompt + requested > limit:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {limit} tokens, but {n_prompt + requested} were "
            f"requested ({n_prompt} in the prompt, {requested} in max_tokens): reduce max_tokens or the prompt",
            param="max_tokens",
        )
    return requested


async def _serve(
    state,
    engine: AsyncEngine,
    request: Request,
    kind: str,
    ids,
    params,
    include_usage,
    stream,
    tool_calls=None,
):
    header = request.headers.get(TRAFFIC_HEADER)
    cluster = engine.traffic.classify(header, len(ids))
    if cluster is None:
        raise BadRequest(
            f"unknown traffic cluster {header!r} in the {TRAFFIC_HEADER} header; known: "
            f"{', '.join(engine.traffic.known_headers())}",
            param=TRAFFIC_HEADER,
        )
    try:
        # NOTE: validate_prompt only reads immutable engine facts (vocab, max_model_len, block counts).
        engine.engine.validate_prompt(ids, params)
    except ValueError as e:
        raise BadRequest(str(e), param="prompt" if kind == "completion" else "messages") from e
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    waiting = engine.waiting(cluster)
    rate = state.window.admission_rate(cluster)
    hint = min(MAX_RETRY_AFTER_S, (waiting + 1) / rate) if rate > 0 else 1.0
    rs = engine.submit(request_id, ids, params, cluster, retry_after_hint=hint)
    builder = ResponseBuilder(
        kind, request_id, state.model_name, engine.engine.tokenizer, include_usage, tool_calls=tool_calls
    )
    if stream:
        release = _releaser(engine, rs)
        # NOTE: if the client leaves before the body starts, the generator never runs and its finally never
        # fires; the background task runs after the response either way, so the request is still aborted.
        return StreamingResponse(
            _stream(rs, builder, include_usage, release),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(release),
        )
    try:
        out = await _collect(engine, rs, request)
    finally:
        engine.request_done()
    if out is None:  # the client went away; nobody reads this
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    if out.finish_reason == "error":
        raise EngineError(out.error or "the engine failed this request")
    return JSONResponse(builder.full(out))


async def _collect(engine: AsyncEngine, rs: RequestStream, request: Request) -> RequestOutput | None:
    """The final output, or None (and the request aborted) when the client disconnects first."""

    async def last() -> RequestOutput:
        final = None
        async for out in rs:
            final = out
        assert final is not None  # noqa: S101 - a stream always ends with a finished output
        return final

    task = asyncio.ensure_future(last())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client disconnected; aborting %s", rs.request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
        if not rs.finished:
            engine.abort(rs.request_id)


def _releaser(engine: AsyncEngine, rs: RequestStream) -> Callable[[], Awaitable[None]]:
    """Abort the request if it is still running and count the handler done: once, however often called."""
    released = False

    async def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        if not rs.finished:
            logger.info("stream of %s ended early (client gone); aborting it", rs.request_id)
            engine.abort(rs.request_id)
        engine.request_done()

    return release


async def _stream(
    rs: RequestStream, builder: ResponseBuilder, include_usage: bool, release: Callable[[], Awaitable[None]]
) -> AsyncIterator[str]:
    try:
        first = builder.first_chunk()
        if first is not None:
            yield first
        async for out in rs:
            if out.finish_reason == "error":
                err = EngineError(out.error or "the engine failed this request")
                yield sse(err.body())
                break
            chunk = builder.delta_chunk(out)
            if chunk is not None:
                yield chunk
            if out.finished and include_usage:
                yield builder.usage_chunk(out)
        yield SSE_DONE
    finally:
        await release()


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())
