"""A tiny exporter with the engine's metric names, for Prometheus-side tests that need no model.

Tests set the latencies it reports; it observes them into real prometheus_client histograms and serves
them over HTTP, so Prometheus computes real histogram_quantile values from real scrapes.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from promserver import free_port

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class FakeEngine:
    def __init__(self, clusters=("chat", "summarization")) -> None:
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
        self.budget = Gauge("stallfree_token_budget", "b", registry=r)
        self.cap = Gauge("stallfree_chunk_cap_tokens", "c", lab, registry=r)
        self.max_waiting = Gauge("stallfree_max_waiting", "mw", lab, registry=r)
        self.max_running = Gauge("stallfree_max_running", "mr", lab, registry=r)
        self.slo_ttft = Gauge("stallfree_slo_ttft_p99_seconds", "s", lab, registry=r)
        self.slo_tbt = Gauge("stallfree_slo_tbt_p99_seconds", "s", lab, registry=r)
        self.requests = Counter("stallfree_requests", "n", ["traffic_cluster", "outcome"], registry=r)
        self.arrivals = Counter("stallfree_request_arrivals", "a", lab, registry=r)
        self.prompt = Counter("stallfree_prompt_tokens", "p", lab, registry=r)
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
        self.port = free_port()
        self._server, _ = start_http_server(self.port, addr="127.0.0.1", registry=r)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        time.sleep(0)
