"""The FastAPI application: OpenAI routes, admin routes, health/readiness, metrics, and error mapping.

`build_app(settings, engine_factory)` is all a caller needs; the engine is built by `engine_factory` in a
background thread at startup (tests pass one that reuses an already loaded model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from stallfree.engine.engine import LLMEngine
from stallfree.engine.server import admin, openai_routes, responses_routes
from stallfree.engine.server.errors import APIError, BadRequest, NotFound
from stallfree.engine.server.metrics import CONTENT_TYPE
from stallfree.engine.server.openai_routes import error_response
from stallfree.engine.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)


def build_app(settings: ServerSettings, engine_factory: Callable[[], LLMEngine]) -> FastAPI:
    state = ServerState(settings, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        await state.shutdown()

    app = FastAPI(title="stallfree", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(admin.router)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the process can serve or is loading; 503 once the engine loop died."""
        dead = state.load_error or (state.engine.dead if state.engine else None)
        if dead:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 once the model is loaded and the engine loop runs, and not draining."""
        try:
            state.ready_engine()
        except APIError as e:
            return JSONResponse({"status": "not ready", "reason": e.message}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_to_bad_request(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.method} {request.url.path}"))
        err = APIError(str(exc.detail))
        err.status_code = exc.status_code
        err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err)


def _validation_to_bad_request(exc: RequestValidationError) -> BadRequest:
    errors = exc.errors()
    if not errors:
        return BadRequest("invalid request")
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    if not loc and e.get("type") == "missing":
        return BadRequest("the body is missing: send a JSON object")
    if not loc:
        return BadRequest("the body must be a JSON object (Content-Type: application/json)")
    field = loc[0] if loc else None
    same_field = [x for x in errors if [str(p) for p in x.get("loc", ()) if p != "body"][:1] == [field]]
    if len(same_field) > 1 and len(loc) > 1:  # a union: pydantic reports one error per member type
        kinds = [str(x["loc"][2]) for x in same_field if len(x.get("loc", ())) > 2]
        got = e.get("input")
        return BadRequest(
            f"{field}: expected one of {', '.join(dict.fromkeys(kinds))}, got {got!r}"[:500], param=field
        )
    param = _dotted(e.get("loc", ())) or None
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got = e.get("input")
    detail = f"{param}: {msg}" if param else msg
    if got is not None and e.get("type") != "missing" and not isinstance(got, (dict, list)):
        detail += f" (got {got!r})"[:200]
    return BadRequest(detail, param=param)


def _dotted(loc) -> str:
    out = ""
    for part in loc:
        if part == "body":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
