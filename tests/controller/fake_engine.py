"""A tiny exporter with the engine's metric names, for Prometheus-side tests that need no model.

Tests set the latencies it reports; it observes them into real prometheus_client histograms and serves
them over HTTP, so Prometheus computes real histogram_quantile values from real scrapes. The same port
answers the engine's admin API (GET/PATCH /admin/v1/config, bearer token) like `stallfree serve` does, so
a controller can apply settings to it; tests read what was applied from `patches`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from promserver import free_port

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class FakeEngine:
    """`host`/`port`: where it listens (a free port on 127.0.0.1 by default). `admin_token`: the bearer
    token the admin API wants (None: no check). Set `admin_error` to an HTTP status to make every
    PATCH fail with it (an engine that cannot take settings)."""

    def __init__(
        self,
        clusters=("chat", "summarization"),
        host: str = "127.0.0.1",
        port: int | None = None,
        admin_token: str | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        lab = ["traffic_cluster"]
        self.tbt = Histogram("stallfree_time_between_tokens_seconds", "tbt", lab, buckets=BUCKETS, registry=r)
        self.ttft = Histogram(
            "stallfree_time_to_first_token_seconds", "ttft", lab, buckets=BUCKETS, registry=r
        )
        self.delay = Histogram(
            "stallfree_scheduling_delay_seconds", "delay", lab, buckets=BUCKETS, registry=r
        )
        self.e2e = Histogram("stallfree_e2e_request_latency_seconds", "e2e", lab, buckets=BUCKETS, registry=r)
        self.iter = Histogram(
            "stallfree_iteration_duration_seconds", "iteration", buckets=BUCKETS, registry=r
        )
        self.iter_prefill = Histogram(
            "stallfree_iteration_prefill_tokens", "p", buckets=(32, 128, 512, 2048), registry=r
        )
        self.iter_decode = Histogram(
            "stallfree_iteration_decode_tokens", "d", buckets=(1, 8, 32, 128), registry=r
        )
        self.waiting = Gauge("stallfree_requests_waiting", "w", lab, registry=r)
        self.running = Gauge("stallfree_requests_running", "r", lab, registry=r)
        self.kv = Gauge("stallfree_kv_cache_usage_ratio", "kv", registry=r)
        self.cal_error = Gauge("stallfree_cost_model_error_ratio", "e", ["quantile"], registry=r)
        self.cal_error.labels("0.5").set(0.04)
        self.cal_error.labels("0.95").set(0.12)
        self.budget = Gauge("stallfree_token_budget", "b", registry=r)
        self.cap = Gauge("stallfree_chunk_cap_tokens", "c", lab, registry=r)
        self.max_waiting = Gauge("stallfree_max_waiting", "mw", lab, registry=r)
        self.max_running = Gauge("stallfree_max_running", "mr", lab, registry=r)
        self.slo_ttft = Gauge("stallfree_slo_ttft_p99_seconds", "s", lab, registry=r)
        self.slo_tbt = Gauge("stallfree_slo_tbt_p99_seconds", "s", lab, registry=r)
        self.requests = Counter("stallfree_requests", "n", ["traffic_cluster", "outcome"], registry=r)
        self.arrivals = Counter("stallfree_request_arrivals", "a", lab, registry=r)
        self.prompt = Counter("stallfree_prompt_tokens", "p", lab, registry=r)
        self.cache_hits = Counter("stallfree_prefix_cache_hit_tokens", "h", lab, registry=r)
        self.cached_share = {c: 0.0 for c in clusters}  # share of prompt tokens served from the prefix cache
        self.gen = Counter("stallfree_generation_tokens", "g", lab, registry=r)
        self.preempt = Counter("stallfree_preemptions", "p", registry=r)
        self.reject = Counter("stallfree_rejections", "r", ["traffic_cluster", "reason"], registry=r)
        self.iters = Counter("stallfree_iterations", "i", ["kind"], registry=r)
        self.clusters = clusters
        self.latency = {c: {"tbt": 0.05, "ttft": 0.5, "delay": 0.1} for c in clusters}
        self.rate = {c: (1.0, 100.0) for c in clusters}  # requests/s, prompt tokens/request
        self.budget.set(512)
        for c in clusters:
            self.slo_tbt.labels(c).set(0.1)
            self.slo_ttft.labels(c).set(1.0)
            self.cap.labels(c).set(256)
            self.max_waiting.labels(c).set(64)
            self.max_running.labels(c).set(32)
            self.reject.labels(c, "queue_full")
            self.requests.labels(c, "stop")
        self.config: dict = {
            "tokenBudget": 512,
            "trafficClusters": {c: {"chunkCap": 256, "maxWaiting": 64, "maxRunning": 32} for c in clusters},
        }
        self.admin_token = admin_token
        self.admin_error: int | None = None
        self.patches: list[dict] = []  # every PATCH /admin/v1/config body that was applied, in order
        self.host, self.port = host, port or free_port()
        self._server = ThreadingHTTPServer((host, self.port), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def apply_patch(self, doc: dict) -> None:
        """Merge a PATCH /admin/v1/config document, as the engine does, and export the new budget."""
        if "tokenBudget" in doc:
            self.config["tokenBudget"] = int(doc["tokenBudget"])
            self.budget.set(self.config["tokenBudget"])
        if "timeTarget" in doc:
            self.config["timeTarget"] = doc["timeTarget"]
        for name, knobs in (doc.get("trafficClusters") or {}).items():
            self.config["trafficClusters"].setdefault(name, {}).update(knobs)
        self.patches.append(doc)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for c in self.clusters:
                lat = self.latency[c]
                for _ in range(5):
                    self.tbt.labels(c).observe(lat["tbt"])
                    self.e2e.labels(c).observe(lat["ttft"] + 20 * lat["tbt"])
                self.ttft.labels(c).observe(lat["ttft"])
                self.delay.labels(c).observe(lat["delay"])
                reqs, tokens = self.rate[c]
                self.arrivals.labels(c).inc(reqs * 0.1)
                self.prompt.labels(c).inc(reqs * tokens * 0.1)
                self.cache_hits.labels(c).inc(reqs * tokens * 0.1 * self.cached_share.get(c, 0.0))
                self.gen.labels(c).inc(reqs * 2)
                self.requests.labels(c, "stop").inc(reqs * 0.1)
                self.running.labels(c).set(4)
                self.waiting.labels(c).set(1)
            self.iter.observe(0.05)
            self.iter_prefill.observe(256)
            self.iter_decode.observe(8)
            self.iters.labels("hybrid").inc()
            self.kv.set(0.3)

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


def _handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _admin_denied(self) -> bool:
            if engine.admin_token and self.headers.get("authorization") != f"Bearer {engine.admin_token}":
                self._send(401, b'{"error": "missing or wrong admin token"}')
                return True
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] == "/metrics":
                self._send(200, generate_latest(engine.registry), CONTENT_TYPE_LATEST)
            elif self.path == "/admin/v1/config":
                if not self._admin_denied():
                    self._send(200, json.dumps(engine.config).encode())
            else:
                self._send(404, b"{}")

        def do_PATCH(self) -> None:  # noqa: N802
            if self.path != "/admin/v1/config":
                self._send(404, b"{}")
            elif not self._admin_denied():
                if engine.admin_error:
                    self._send(engine.admin_error, b'{"error": "the engine cannot take settings now"}')
                    return
                doc = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                engine.apply_patch(doc)
                self._send(200, json.dumps(engine.config).encode())

        def log_message(self, format: str, *args: object) -> None:  # quiet: tests read `patches`
            pass

    return Handler
