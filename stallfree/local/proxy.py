"""One OpenAI endpoint in front of the local engine replicas.

/v1/* goes to the replica with the fewest requests in flight through this proxy (ties: the first), streamed
through unchanged (SSE included); a replica that refuses the connection is skipped before any byte is sent,
one that drops it before answering gets the request once more, and a transport failure is a 502 JSON error.
A stream never ends silently: SSE is relayed event by event, and when the replica's stream breaks (it died,
the connection dropped) or ends without `data: [DONE]` (/v1/responses: without its terminal event,
response.completed / incomplete / failed), the client gets an error event in the OpenAI shape and then
[DONE], so the openai SDK raises instead of returning a short answer as if it were whole.
Also: /health, /ready, /metrics (the controller's decisions) and GET /admin/v1/status (the status document,
bearer token only when one is configured or the proxy binds beyond loopback).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


SSE_DONE = b"data: [DONE]\n\n"
# A /v1/responses stream ends with one of these events instead of [DONE].
RESPONSES_TERMINAL = tuple(
    f"event: {kind}\n".encode()
    for kind in ("response.completed", "response.incomplete", "response.failed", "error")
)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\n" + SSE_DONE


async def relay_sse(resp: httpx.Response, base: str) -> AsyncIterator[bytes]:
    """The replica's SSE body, whole events at a time; an error event when it breaks or ends early."""
    pending, done = b"", False
    try:
        async for chunk in resp.aiter_raw():
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut < 0:
                continue
            events, pending = pending[: cut + 2], pending[cut + 2 :]
            done = ends_stream(events)
            yield events
    except httpx.TransportError as e:
        log.warning("replica %s broke a stream mid-way: %r", base, e)
        yield _sse_error(f"the engine replica serving this stream failed mid-way ({type(e).__name__}); "
                         "the output is incomplete: retry the request")  # fmt: skip
        return
    if not done:
        log.warning("replica %s ended a stream without [DONE]", base)
        yield _sse_error("the engine replica ended this stream before it was complete; retry the request")


def ends_stream(events: bytes) -> bool:
    """Whether whole SSE events end with the stream's last: [DONE], or a Responses terminal event."""
    if events.endswith(SSE_DONE):
        return True
    start = events.rfind(b"\n\n", 0, len(events) - 2)
    return events[start + 2 if start >= 0 else 0 :].startswith(RESPONSES_TERMINAL)


class Router:
    """Least-loaded choice among the replicas that are ready now."""

    def __init__(self, endpoints: Callable[[], list[str]]) -> None:
        self.endpoints = endpoints
        self.in_flight: dict[str, int] = {}

    def order(self) -> list[str]:
        eps = self.endpoints()
        return sorted(eps, key=lambda b: (self.in_flight.get(b, 0), eps.index(b)))


def build_app(
    endpoints: Callable[[], list[str]],
    status: Callable[[], dict],
    metrics: Callable[[], tuple[bytes, str]],
    admin_token: str | None,
) -> Starlette:
    router = Router(endpoints)
    # Idle connections expire before the engines' own keep-alive timeout (uvicorn's 5 s): reusing one the
    # engine is closing at that moment fails the request with a reset (seen once in a live run).
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(max_connections=512, keepalive_expiry=2.0),
    )

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        queue, retried = router.order(), False
        while queue:
            base = queue.pop(0)
            url = f"{base}{request.url.path}"
            req = client.build_request(
                request.method, url, params=request.query_params, headers=headers, content=body
            )
            try:
                resp = await client.send(req, stream=True)
            except httpx.ConnectError as e:
                log.warning("replica %s refused the connection (%s); trying the next", base, e)
                continue
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                # Closed before any response byte: the request is tried once more, on a fresh connection.
                if not retried:
                    log.warning("replica %s closed the connection before answering (%r); retrying", base, e)
                    queue.insert(0, base)
                    retried = True
                    continue
                return _error(502, f"engine replica {base} closed the connection before answering: {e!r}",
                              "bad_gateway")  # fmt: skip
            except httpx.TransportError as e:
                return _error(502, f"engine replica {base} failed: {e!r}", "bad_gateway")
            router.in_flight[base] = router.in_flight.get(base, 0) + 1

            async def done(resp: httpx.Response = resp, base: str = base) -> None:
                router.in_flight[base] -= 1
                await resp.aclose()

            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
            is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(
                relay_sse(resp, base) if is_sse else resp.aiter_raw(),
                status_code=resp.status_code,
                headers=out_headers,
                background=BackgroundTask(done),
            )
        return _error(503, "no engine replica is ready yet; retry shortly", "service_unavailable")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        n = len(endpoints())
        return JSONResponse({"ready": n > 0, "replicas": n}, 200 if n else 503)

    async def admin_status(request: Request) -> Response:
        if admin_token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
                return _error(
                    401, "the admin API needs `Authorization: Bearer <admin token>`", "authentication_error"
                )
        return JSONResponse(status())

    async def prom(_: Request) -> Response:
        body, content_type = metrics()
        return Response(body, media_type=content_type)

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", prom),
        Route("/admin/v1/status", admin_status),
        Route("/v1/{path:path}", forward, methods=["GET", "POST", "DELETE"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)
