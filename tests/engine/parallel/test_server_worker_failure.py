"""A server over a PP=2 engine: a worker that dies mid-request ends the request with an explicit error and
/ready turns not-ready within seconds. (While idle, the engine loop asks `check_health()` every poll.)"""

import os
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from stallfree.engine.config import CacheConfig, EngineConfig, ParallelConfig
from stallfree.engine.engine import create_engine
from stallfree.engine.server.app import build_app
from stallfree.engine.server.state import ServerSettings

DETECT_S = 10.0


def start(loaded):
    cfg = EngineConfig(
        cache=CacheConfig(num_kv_blocks=128), parallel=ParallelConfig(pipeline_parallel_size=2)
    )
    app = build_app(ServerSettings(), lambda: create_engine(cfg, loaded=loaded))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return app, server, thread, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the PP=2 server did not become ready")


def wait_not_ready(url: str) -> httpx.Response:
    deadline = time.monotonic() + DETECT_S
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/ready", timeout=5)
        if r.status_code == 503:
            return r
        time.sleep(0.1)
    pytest.fail(f"/ready still answers {r.status_code} {DETECT_S} s after the worker died")


def test_dead_worker_fails_the_request_and_the_ready_check(default_model):
    app, server, thread, url = start(default_model)
    try:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "temperature": 0,
        }
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        engine = app.state.server.engine.engine
        victim = list(engine.executor.procs.values())[1].pid
        result = {}

        def long_request():
            b = dict(body, max_tokens=3000, ignore_eos=True)
            result["r"] = httpx.post(f"{url}/v1/completions", json=b, timeout=120)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(2.0)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        r = wait_not_ready(url)
        assert time.monotonic() - killed < DETECT_S
        assert "worker rank 1" in r.json()["reason"], r.json()
        t.join(30)
        assert not t.is_alive(), "the in-flight request hung"
        assert result["r"].status_code >= 500 or "error" in result["r"].text, result["r"].text
        assert "worker" in result["r"].text
    finally:
        server.should_exit = True
        thread.join(30)
