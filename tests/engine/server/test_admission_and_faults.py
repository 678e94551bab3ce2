"""Overload (429 + Retry-After, no accepted request lost), client disconnects (blocks freed), engine
failures (500 / SSE error event) and a dead engine loop (503)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import API_KEY, start_server, wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(default_model):
    """A server whose default cluster admits one running and two waiting requests."""
    s = start_server(
        default_model, traffic={"trafficClusters": [{"name": "default", "maxWaiting": 2, "maxRunning": 1}]}
    )
    yield s
    s.stop()


def test_overload_gets_429_with_retry_after_and_loses_nothing(tiny):
    body = {"prompt": "Count slowly:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: _post(tiny.url, body), range(12)))
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(rejected) == 12, [r.status_code for r in responses]
    assert ok and rejected
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert "maxWaiting" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in ok), "an accepted request lost tokens"
    assert tiny.metric("stallfree_rejections_total", traffic_cluster="default", reason="queue_full") == len(
        rejected
    )
    assert tiny.metric("stallfree_requests_total", traffic_cluster="default", outcome="length") == len(ok)
    assert tiny.metric("stallfree_requests_total", traffic_cluster="default", outcome="rejected") == len(
        rejected
    )
    assert tiny.metric("stallfree_max_waiting", traffic_cluster="default") == 2
    # once the queue drains, requests are admitted again
    assert _post(tiny.url, body).status_code == 200


def test_n_choices_are_admitted_together_or_refused_together(tiny):
    """maxWaiting 2: n=3 can never wait there (400 naming n); with one request running and one waiting, an
    n=2 request does not fit and gets 429, and nothing of it runs."""
    too_many = _post(tiny.url, {"prompt": "Hi", "max_tokens": 1, "n": 3})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    long = {"prompt": "Count slowly:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    arrivals = tiny.metric("stallfree_request_arrivals_total", traffic_cluster="default")
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(_post, tiny.url, long) for _ in range(2)]
        wait_for(lambda: tiny.metric("stallfree_request_arrivals_total", traffic_cluster="default")
                 >= arrivals + 2)  # fmt: skip
        pair = _post(tiny.url, {**long, "n": 2})
        assert all(f.result().status_code == 200 for f in busy)
    assert pair.status_code == 429, pair.text
    assert tiny.metric("stallfree_request_arrivals_total", traffic_cluster="default") == arrivals + 2
    both = _post(tiny.url, {**long, "max_tokens": 3, "n": 2})  # the queue drained: both choices run
    assert both.status_code == 200 and len(both.json()["choices"]) == 2


def _idle(server) -> bool:
    return (
        server.metric("stallfree_kv_cache_usage_ratio") == 0.0
        and server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks
        and not server.engine.has_unfinished_requests()
    )


def test_stream_disconnect_aborts_and_frees_blocks(server):
    aborted = server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    assert wait_for(lambda: server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
                    == aborted + 1)  # fmt: skip
    assert wait_for(lambda: _idle(server)), "the aborted request's KV blocks were not freed"


def test_non_streaming_disconnect_aborts_too(server):
    aborted = server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
    with pytest.raises(httpx.ReadTimeout):
        _post(server.url, {"prompt": "Write an essay.", "max_tokens": 400, "ignore_eos": True}, timeout=1.5)
    assert wait_for(lambda: server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
                    == aborted + 1)  # fmt: skip
    assert wait_for(lambda: _idle(server))


@pytest.fixture
def fresh(default_model):
    s = start_server(default_model)
    yield s
    s.stop()


def test_forward_failure_becomes_500_and_an_sse_error_event(fresh, monkeypatch):
    runner = fresh.engine.executor.runner

    def broken(*a, **kw):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(runner, "execute", broken)
    r = _post(fresh.url, {"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 500 and "simulated device fault" in r.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    r = httpx.post(f"{fresh.url}/v1/chat/completions", headers=AUTH, json=body, timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "simulated device fault" in json.loads(events[-2])["error"]["message"]
    assert fresh.metric("stallfree_requests_total", traffic_cluster="default", outcome="error") == 2
    monkeypatch.undo()
    assert _post(fresh.url, {"prompt": "Hi", "max_tokens": 2}).status_code == 200, "the server should recover"


def test_a_fault_while_streaming_ends_the_stream_with_an_error_event(server, monkeypatch):
    """The server's own fault mid-stream (here: building a chunk raises): the openai SDK raises APIError with
    the message, the request is aborted, and the server serves on."""
    from openai import APIConnectionError, APIError, OpenAI

    from stallfree.engine.server.responses import ResponseBuilder

    calls = 0
    real = ResponseBuilder.delta_chunk

    def flaky(self, out, index=0):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated chunk fault")
        return real(self, out, index)

    monkeypatch.setattr(ResponseBuilder, "delta_chunk", flaky)
    aborted = server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    text = ""
    with pytest.raises(APIError) as e:
        for chunk in client.completions.create(model=None, prompt="Count:", max_tokens=50, stream=True,
                                               extra_body={"ignore_eos": True}):  # fmt: skip
            text += chunk.choices[0].text
    assert not isinstance(e.value, APIConnectionError)
    assert "simulated chunk fault" in str(e.value) and text
    assert wait_for(lambda: server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
                    == aborted + 1)  # fmt: skip
    monkeypatch.undo()
    assert _post(server.url, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_dead_engine_loop_fails_requests_and_turns_unready(fresh, monkeypatch):
    def broken():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(fresh.engine.scheduler, "schedule", broken)
    r = _post(fresh.url, {"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 500 and "scheduler bug" in r.json()["error"]["message"]
    assert httpx.get(f"{fresh.url}/ready").status_code == 503
    assert httpx.get(f"{fresh.url}/health").status_code == 503
    r = _post(fresh.url, {"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 503 and "engine loop stopped" in r.json()["error"]["message"]


def test_disconnect_before_the_stream_starts_still_aborts(server):
    """A client that sends a streaming request and hangs up at once: the request must not run on."""
    import json
    import socket
    from urllib.parse import urlparse

    aborted = server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
    body = json.dumps(
        {"prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    )
    u = urlparse(server.url)
    auth = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(raw.encode())
    assert wait_for(lambda: server.metric("stallfree_requests_total", traffic_cluster="default", outcome="abort")
                    == aborted + 1)  # fmt: skip
    assert wait_for(lambda: _idle(server)), "the request kept running after its client left"
    # The handler counted itself done, so a drain would not wait for it forever.
    assert wait_for(lambda: server.state.engine.num_in_flight == 0)


def test_the_engine_is_stepped_on_the_thread_that_built_it(default_model):
    """Torch's OpenMP pool belongs to the thread that first runs a parallel region: a server that builds
    the model on one thread and steps it on another keeps two pools, and on a small box every kernel call
    then sleeps and is woken (a batch-1 decode step 11 -> 36 ms on 2 cores; docs/engine.md)."""
    built: list[int] = []
    stepped: set[int] = set()

    def spy(engine) -> None:
        built.append(threading.get_ident())
        step = engine.step

        def recorded_step():
            stepped.add(threading.get_ident())
            return step()

        engine.step = recorded_step

    s = start_server(default_model, on_build=spy)
    try:
        r = _post(s.url, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
    assert len(built) == 1 and built[0] != threading.get_ident()
    assert stepped == {built[0]}, "the engine loop ran on another thread than the one that built the engine"
