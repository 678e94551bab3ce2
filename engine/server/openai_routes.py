"""/v1/completions, /v1/chat/completions and /v1/models, and the admission and streaming helpers that
/v1/responses (responses_routes.py) shares with them."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from stallfree.engine.outputs import RequestOutput
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.server.async_engine import AsyncEngine, RequestStream
from stallfree.engine.server.constraints import chat_prompt, constrain, request_constraint
from stallfree.engine.server.errors import APIError, BadRequest, ContextLengthExceeded, EngineError
from stallfree.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.engine.server.responses import SSE_DONE, ResponseBuilder, sse
from stallfree.engine.server.state import ServerState
from stallfree.engine.server.tool_calls.stream import ToolCallExtractor

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
    # Every served name, the first first (as vLLM lists its --served-model-name).
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "stallfree",
                "max_model_len": engine.engine.max_model_len,
            }
            for name in state.model_names
        ],
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = get_state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    body.check_unsupported(engine.engine.model_config.vocab_size)
    prompt = body.single_prompt()
    tok = engine.engine.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = _max_tokens(engine, len(ids), body.max_tokens, "prompt")
    params = body.sampling_params(max_tokens, body.logprobs)
    params = await constrain(engine.engine, params, request_constraint(body), body.constraint_field())
    return await _serve(state, engine, request, "completion", ids, params, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    engine = state.ready_engine()
    state.check_model(body.model)
    body.check_unsupported(engine.engine.model_config.vocab_size)
    chat = await prepare_chat(state, engine, body)
    return await _serve(state, engine, request, "chat", chat.token_ids, chat.params, body, chat.extractors)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request made ready for the engine: its prompt, its sampling (constraint compiled) and the
    readers of its tool calls (None without tools)."""

    token_ids: list[int]
    params: SamplingParams
    extractors: list[ToolCallExtractor] | None


async def prepare_chat(
    state: ServerState,
    engine: AsyncEngine,
    body: ChatCompletionRequest,
    *,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> PreparedChat:
    """Prompt (chat template, tools), token limit, sampling and constraint of a chat request: one path for
    /v1/chat/completions and /v1/responses. The *_param names are the request's fields, for the 400s."""
    prompt = chat_prompt(engine.engine, body, state.settings.tool_call_parser)
    ids = prompt.token_ids
    max_tokens = _max_tokens(engine, len(ids), body.requested_max_tokens(), prompt_param, max_tokens_param)
    params = body.sampling_params(max_tokens, body.num_logprobs())
    so = request_constraint(body, prompt.plan)
    field = "tools" if so is not None and so is prompt.plan.structured_outputs else body.constraint_field()
    params = await constrain(engine.engine, params, so, field)
    return PreparedChat(ids, params, prompt.extractors(body.n))


def _max_tokens(
    engine: AsyncEngine, n_prompt: int, requested: int | None, param: str, max_param: str = "max_tokens"
) -> int:
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
            f"requested ({n_prompt} in the prompt, {requested} in {max_param}): reduce {max_param} or the prompt",
            param=max_param,
        )
    return requested


async def _serve(state, engine: AsyncEngine, request: Request, kind: str, ids, params, body, tool_calls=None):
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    param = "prompt" if kind == "completion" else "messages"
    rs = admit(state, engine, request, request_id, ids, params, n=body.n, prompt_param=param)
    builder = ResponseBuilder(
        kind,
        request_id,
        state.model_name,
        engine.engine.tokenizer,
        body.include_usage,
        n=body.n,
        continuous_usage=body.continuous_usage,
        num_prompt_tokens=len(ids),
        tool_calls=tool_calls,
    )
    if body.stream:
        return event_stream(engine, rs, lambda release: _stream(rs, builder, body.include_usage, release))
    outs = await collect_whole(engine, rs, request)
    if outs is None:  # the client went away; nobody reads this
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    return JSONResponse(builder.full(outs))


def admit(
    state: ServerState,
    engine: AsyncEngine,
    request: Request,
    request_id: str,
    ids: list[int],
    params: SamplingParams,
    *,
    n: int = 1,
    prompt_param: str = "messages",
) -> RequestStream:
    """Classify the request into its traffic cluster and submit it (429 when the cluster's queue is full).
    Every accepted request must end with `engine.request_done()`: collect_whole and event_stream see to it."""
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
        raise BadRequest(str(e), param=prompt_param) from e
    waiting = engine.waiting(cluster)
    rate = state.window.admission_rate(cluster)
    hint = min(MAX_RETRY_AFTER_S, (waiting + 1) / rate) if rate > 0 else 1.0
    return engine.submit(request_id, ids, params, cluster, retry_after_hint=hint, n=n)


async def collect_whole(
    engine: AsyncEngine, rs: RequestStream, request: Request
) -> list[RequestOutput] | None:
    """Each choice's final output of an admitted request; None when the client left first (the request is
    aborted). EngineError when the engine failed it."""
    try:
        outs = await _collect(engine, rs, request)
    finally:
        engine.request_done()
    failed = next((o for o in outs or () if o.finish_reason == "error"), None)
    if failed is not None:
        raise EngineError(failed.error or "the engine failed this request")
    return outs


def event_stream(
    engine: AsyncEngine,
    rs: RequestStream,
    events: Callable[[Callable[[], Awaitable[None]]], AsyncIterator[str]],
) -> StreamingResponse:
    """The SSE response of an admitted request. `events(release)` yields its events and must await
    `release()` when it ends; the release also runs after the response, whatever happened."""
    release = _releaser(engine, rs)
    # NOTE: if the client leaves before the body starts, the generator never runs and its finally never
    # fires; the background task runs after the response either way, so the request is still aborted.
    return StreamingResponse(
        events(release),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(release),
    )


async def _collect(engine: AsyncEngine, rs: RequestStream, request: Request) -> list[RequestOutput] | None:
    """Each choice's final output, or None (and the request aborted) when the client disconnects first."""

    async def last() -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        async for out in rs:
            if out.finished:
                final[out.request_id] = out
                if out.finish_reason == "error":  # no point waiting for the other choices
                    break
        return [final[c] for c in rs.children if c in final]

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
            engine.abort_stream(rs)


def _releaser(engine: AsyncEngine, rs: RequestStream) -> Callable[[], Awaitable[None]]:
    """Abort the request if it is still running and count the handler done: once, however often called."""
    released = False

    async def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        if not rs.finished:
            logger.info("stream of %s ended early; aborting what still runs", rs.request_id)
            engine.abort_stream(rs)
        engine.request_done()

    return release


async def _stream(
    rs: RequestStream, builder: ResponseBuilder, include_usage: bool, release: Callable[[], Awaitable[None]]
) -> AsyncIterator[str]:
    """SSE chunks of every choice, interleaved as they come, each with its index; then usage and [DONE].

    NOTE: a stream never ends silently: when the engine fails the request, or building a chunk raises, the
    client gets an error event in the OpenAI shape (the openai SDK raises APIError on it), then [DONE]."""
    try:
        try:
            for chunk in builder.first_chunks():
                yield chunk
            final: dict[str, RequestOutput] = {}
            async for out in rs:
                if out.finish_reason == "error":
                    err = EngineError(out.error or "the engine failed this request")
                    yield sse(err.body())
                    break
                chunk = builder.delta_chunk(out, rs.index(out.request_id))
                if chunk is not None:
                    yield chunk
                if out.finished:
                    final[out.request_id] = out
            else:
                if include_usage:
                    yield builder.usage_chunk([final[c] for c in rs.children])
        except Exception as e:  # noqa: BLE001 - the client must hear about it, not see a short answer
            logger.exception("stream of %s failed", rs.request_id)
            yield sse(EngineError(f"the server failed while streaming: {type(e).__name__}: {e}").body())
        yield SSE_DONE
    finally:
        await release()


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())
