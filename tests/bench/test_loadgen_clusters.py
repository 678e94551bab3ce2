"""The load generator's traffic-cluster header: one for the whole run, or each request's own.

An in-process mock transport stands in for the server (no model, no sockets): it answers every request
with a two-token SSE stream and remembers the x-traffic-cluster header each request carried.
"""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest

from stallfree.bench import loadgen
from stallfree.bench.metrics import OK
from stallfree.bench.traces import TraceRequest, Workload


def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def mock_server(seen: dict[int, str | None]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen[len(body["prompt"])] = request.headers.get(
            "x-traffic-cluster"
        )  # prompt length names the request
        token = {"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]}
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        return httpx.Response(
            200, content=sse(token, token, usage), headers={"content-type": "text/event-stream"}
        )

    return httpx.MockTransport(handle)


def run(monkeypatch, requests: list[TraceRequest], **kw) -> tuple[list, dict[int, str | None]]:
    seen: dict[int, str | None] = {}
    client = functools.partial(httpx.AsyncClient, transport=mock_server(seen))
    monkeypatch.setattr(loadgen.httpx, "AsyncClient", client)
    wl = Workload("t", 1.0, 8192, 0, None, tuple(requests), 0)
    records = asyncio.run(loadgen.run_workload("http://server", wl, model="m", **kw))
    return records, seen


@pytest.mark.parametrize("run_cluster", [None, "batch"])
def test_each_request_sends_its_own_cluster_else_the_runs(monkeypatch, run_cluster):
    reqs = [
        TraceRequest(0, 5, 2, 0.0, traffic_cluster="chat"),
        TraceRequest(1, 6, 2, 0.0, traffic_cluster="summarization"),
        TraceRequest(2, 7, 2, 0.0),  # no cluster of its own
    ]
    records, seen = run(monkeypatch, reqs, traffic_cluster=run_cluster)
    assert seen == {5: "chat", 6: "summarization", 7: run_cluster}
    assert [r.outcome for r in records] == [OK] * 3
    assert all(len(r.token_times) == 2 for r in records)


def test_requests_without_clusters_behave_as_before(monkeypatch):
    records, seen = run(monkeypatch, [TraceRequest(0, 5, 2, 0.0)], traffic_cluster="chat")
    assert seen == {5: "chat"} and records[0].outcome == OK
