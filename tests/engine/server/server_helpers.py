"""A real stallfree server on a free local port, in a background thread, reusing the loaded model."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from stallfree.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.engine.engine import LLMEngine
from stallfree.engine.server.app import build_app
from stallfree.engine.server.state import ServerSettings
from stallfree.engine.server.traffic import parse_traffic_config

API_KEY = "test-key"
ADMIN = "admin-secret"


@dataclass
class LiveServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.server

    @property
    def engine(self):
        return self.state.engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample (labels must match exactly the ones given, in any order); 0 if absent."""
        text = self.metrics()
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if got == labels:
                return float(m.group(3))
        return 0.0


def start_server(
    loaded,
    *,
    traffic: dict | None = None,
    api_key: str | None = API_KEY,
    admin_token: str | None = ADMIN,
    settings_host: str = "127.0.0.1",
    num_kv_blocks: int = 256,
    max_num_seqs: int = 64,
    policy: str = "sarathi",
    drain_timeout_s: float = 10.0,
    enable_prefix_caching: bool = True,
    on_build=None,
    **engine_kw,
) -> LiveServer:
    """engine_kw: more EngineConfig fields (e.g. dtype, quantization) for the engine. on_build(engine), if
    given, is called with the new engine in the server's build (the engine factory, on its thread)."""
    config = parse_traffic_config(traffic or {})
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, tunables=config.tunables()),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
        **engine_kw,
    )
    settings = ServerSettings(
        host=settings_host,
        api_key=api_key,
        admin_token=admin_token,
        traffic=config,
        drain_timeout_s=drain_timeout_s,
    )

    def build() -> LLMEngine:
        engine = LLMEngine(engine_config, loaded=loaded)
        if on_build is not None:
            on_build(engine)
        return engine

    app = build_app(settings, build)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return LiveServer(url, app, server, thread)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the test server did not become ready in 60 s")


def wait_for(cond, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()
