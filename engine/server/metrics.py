"""Prometheus metrics: the ONLY module that imports prometheus_client.

Names are a contract (budget controller, Grafana dashboard, alerts): `stallfree_*` with units and the
`traffic_cluster` label, plus vLLM's names (label `model_name`, vLLM's buckets) for everything we measure
that vLLM also reports, so gateways, autoscalers and dashboards made for vLLM read them unchanged; `stallfree_*`
keeps what vLLM has no name for. Each server instance owns its own CollectorRegistry, so several servers can
live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as _CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stallfree.engine.outputs import IterationStats, RequestMetrics
from stallfree.engine.server.observer import EngineObserver

CONTENT_TYPE = _CONTENT_TYPE
TC = ("traffic_cluster",)
# Fine-grained enough to read a P99 TBT anywhere between 5 ms and 10 s.
TBT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05,
    0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8,
    1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
)  # fmt: skip
RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
    2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
    6144, 8192, 16384,
)  # fmt: skip
OUTCOMES = ("stop", "length", "abort", "error", "rejected")
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_FINISH_REASONS = ("stop", "length", "abort")  # vllm:request_success_total's finished_reason


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class PrometheusMetrics(EngineObserver):
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self._clusters: set[str] = set()
        h, g, c = Histogram, Gauge, Counter
        self.ttft = h("stallfree_time_to_first_token_seconds", "Arrival to first output token.", TC,
                      buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tbt = h("stallfree_time_between_tokens_seconds", "Every gap between consecutive output tokens.",
                     TC, buckets=TBT_BUCKETS, registry=r)  # fmt: skip
        self.e2e = h("stallfree_e2e_request_latency_seconds", "Arrival to finish.", TC,
                     buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.sched_delay = h("stallfree_scheduling_delay_seconds", "Arrival to first scheduled iteration.",
                             TC, buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.iter_time = h("stallfree_iteration_duration_seconds", "Wall time of one engine iteration.",
                           buckets=TBT_BUCKETS, registry=r)  # fmt: skip
        self.iter_predicted = h("stallfree_iteration_predicted_seconds", "What the engine's cost model "
                                "predicted an iteration would take, before it ran.", buckets=TBT_BUCKETS,
                                registry=r)  # fmt: skip
        self.iter_ratio = h("stallfree_iteration_prediction_ratio", "Predicted over observed iteration time.",
                            buckets=RATIO_BUCKETS, registry=r)  # fmt: skip
        self.iter_limit = g("stallfree_iteration_time_limit_seconds", "The time the last iteration had to fit "
                            "(time-budgeted iterations; 0 = no limit).", registry=r)  # fmt: skip
        self.cal_error = g("stallfree_cost_model_error_ratio", "|predicted / observed - 1| of iteration times "
                           "over the last iterations (the cost model's calibration health).", ("quantile",),
                           registry=r)  # fmt: skip
        self.time_target = g("stallfree_time_target_ratio", "Share of the strictest P99 TBT SLO an iteration "
                             "may take (0 = a fixed token budget).", registry=r)  # fmt: skip
        self.iter_prefill = h("stallfree_iteration_prefill_tokens", "Prefill tokens per iteration.",
                              buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.iter_decode = h("stallfree_iteration_decode_tokens", "Decode tokens per iteration.",
                             buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.running = g("stallfree_requests_running", "Requests running in the engine.", TC, registry=r)
        self.waiting = g("stallfree_requests_waiting", "Requests waiting for admission.", TC, registry=r)
        self.kv_usage = g(
            "stallfree_kv_cache_usage_ratio", "Share of KV-cache blocks in use (0..1).", registry=r
        )
        self.budget = g("stallfree_token_budget", "Current per-iteration token budget.", registry=r)
        self.chunk_cap = g("stallfree_chunk_cap_tokens", "Prefill tokens per iteration for the cluster "
                           "(0 = only the budget).", TC, registry=r)  # fmt: skip
        self.max_waiting = g("stallfree_max_waiting", "Admission bound on waiting requests (0 = none).", TC,
                             registry=r)  # fmt: skip
        self.max_running = g("stallfree_max_running", "Bound on running requests (0 = none).", TC, registry=r)
        self.slo_ttft = g("stallfree_slo_ttft_p99_seconds", "P99 TTFT objective.", TC, registry=r)
        self.slo_tbt = g("stallfree_slo_tbt_p99_seconds", "P99 TBT objective.", TC, registry=r)
        self.requests = c("stallfree_requests", "Requests by outcome.", (*TC, "outcome"), registry=r)
        self.arrivals = c("stallfree_request_arrivals", "Accepted requests.", TC, registry=r)
        self.prompt_tokens = c(
            "stallfree_prompt_tokens", "Prompt tokens, counted on arrival.", TC, registry=r
        )
        self.gen_tokens = c("stallfree_generation_tokens", "Generated tokens.", TC, registry=r)
        self.preemptions = c("stallfree_preemptions", "Requests preempted (recompute).", registry=r)
        self.rejections = c("stallfree_rejections", "Requests refused at admission.", (*TC, "reason"),
                            registry=r)  # fmt: skip
        self.iterations = c("stallfree_iterations", "Engine iterations by kind.", ("kind",), registry=r)
        self.cache_queries = c("stallfree_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                               "cache at admission.", TC, registry=r)  # fmt: skip
        self.cache_hits = c("stallfree_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache "
                            "(not prefilled).", TC, registry=r)  # fmt: skip
        self.cache_ratio = g("stallfree_prefix_cache_hit_ratio", "Share of looked-up prompt tokens found in "
                             "the prefix cache since start (0..1).", TC, registry=r)  # fmt: skip
        self.cache_blocks = g(
            "stallfree_prefix_cache_blocks", "KV blocks held in the prefix cache.", registry=r
        )
        self._cache_totals: dict[str, list[int]] = {}  # cluster -> [queries, hits]
        m = ("model_name",)
        self.v_waiting = g("vllm:num_requests_waiting", "Requests waiting.", m, registry=r)
        self.v_running = g("vllm:num_requests_running", "Requests running.", m, registry=r)
        self.v_kv = g("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%).", m, registry=r)
        self.v_ttft = h("vllm:time_to_first_token_seconds", "Time to first token.", m,
                        buckets=VLLM_TTFT_BUCKETS, registry=r)  # fmt: skip
        self.v_itl = h("vllm:inter_token_latency_seconds", "Inter-token latency.", m,
                       buckets=VLLM_ITL_BUCKETS, registry=r)  # fmt: skip
        self._vllm_request_metrics(m)
        self.v_cache_queries = c(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", m, registry=r
        )
        self.v_cache_hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", m, registry=r)
        self.v_cache_queries.labels(model_name)
        self.v_cache_hits.labels(model_name)
        for kind in ("prefill", "decode", "hybrid"):
            self.iterations.labels(kind)
        for reason in VLLM_FINISH_REASONS:
            self.v_success.labels(model_name, reason)
        for counter in (self.v_prompt_tokens, self.v_gen_tokens, self.v_preemptions):
            counter.labels(model_name)  # series at zero before the first request
        for hist in (self.v_ttft, self.v_itl, *self._v_request_histograms):
            hist.labels(model_name)
        for gauge in (self.v_waiting, self.v_running, self.v_kv):
            gauge.labels(model_name).set(0)

    def _vllm_request_metrics(self, m: tuple[str, ...]) -> None:
        r, h, c = self.registry, Histogram, Counter
        lat = VLLM_REQUEST_LATENCY_BUCKETS
        self.v_e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.", m, buckets=lat,
                       registry=r)  # fmt: skip
        self.v_queue = h("vllm:request_queue_time_seconds", "Time in the waiting queue (arrival to first "
                         "scheduled).", m, buckets=lat, registry=r)  # fmt: skip
        self.v_prefill = h("vllm:request_prefill_time_seconds", "Prefill time (first scheduled to first "
                           "token).", m, buckets=lat, registry=r)  # fmt: skip
        self.v_decode = h("vllm:request_decode_time_seconds", "Decode time (first token to last token).", m,
                          buckets=lat, registry=r)  # fmt: skip
        self.v_inference = h("vllm:request_inference_time_seconds", "Running time (first scheduled to "
                             "finish).", m, buckets=lat, registry=r)  # fmt: skip
        self.v_tpot = h("vllm:request_time_per_output_token_seconds", "Mean time per output token of a "
                        "request.", m, buckets=VLLM_ITL_BUCKETS, registry=r)  # fmt: skip
        tokens = buckets_1_2_5(1_000_000)
        self.v_req_prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request.", m, buckets=tokens,
                              registry=r)  # fmt: skip
        self.v_req_gen = h("vllm:request_generation_tokens", "Generated tokens per request.", m,
                           buckets=tokens, registry=r)  # fmt: skip
        self.v_max_tokens = h("vllm:request_params_max_tokens", "max_tokens of each request.", m,
                              buckets=tokens, registry=r)  # fmt: skip
        self.v_iter_tokens = h("vllm:iteration_tokens_total", "Tokens per engine iteration.", m,
                               buckets=VLLM_ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self._v_request_histograms = (self.v_e2e, self.v_queue, self.v_prefill, self.v_decode, self.v_inference,
                                      self.v_tpot, self.v_req_prompt, self.v_req_gen, self.v_max_tokens,
                                      self.v_iter_tokens)  # fmt: skip
        self.v_prompt_tokens = c("vllm:prompt_tokens", "Prompt tokens, counted on arrival.", m, registry=r)
        self.v_gen_tokens = c("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.v_preemptions = c("vllm:num_preemptions", "Preemptions (recompute).", m, registry=r)
        self.v_success = c("vllm:request_success", "Finished requests by finish reason.",
                           (*m, "finished_reason"), registry=r)  # fmt: skip

    def _cluster(self, name: str) -> None:
        """Create a cluster's series at zero so dashboards see it before its first request."""
        if name in self._clusters:
            return
        self._clusters.add(name)
        for o in OUTCOMES:
            self.requests.labels(name, o)
        for metric in (
            self.arrivals,
            self.prompt_tokens,
            self.gen_tokens,
            self.cache_queries,
            self.cache_hits,
        ):
            metric.labels(name)
        self.running.labels(name).set(0)
        self.waiting.labels(name).set(0)

    # ---- observer ----------------------------------------------------------------------------------
    def on_arrival(self, cluster: str, prompt_tokens: int) -> None:
        self._cluster(cluster)
        self.arrivals.labels(cluster).inc()
        self.prompt_tokens.labels(cluster).inc(prompt_tokens)
        self.v_prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def on_rejected(self, cluster: str, reason: str) -> None:
        self._cluster(cluster)
        self.rejections.labels(cluster, reason).inc()
        self.requests.labels(cluster, "rejected").inc()

    def on_scheduled(self, cluster: str, delay: float) -> None:
        self.sched_delay.labels(cluster).observe(delay)

    def on_first_token(self, cluster: str, ttft: float) -> None:
        self.ttft.labels(cluster).observe(ttft)
        self.v_ttft.labels(self.model_name).observe(ttft)

    def on_token_gaps(self, cluster: str, gaps: list[float]) -> None:
        tbt, itl = self.tbt.labels(cluster), self.v_itl.labels(self.model_name)
        for gap in gaps:
            tbt.observe(gap)
            itl.observe(gap)

    def on_generation_tokens(self, cluster: str, n: int) -> None:
        self.gen_tokens.labels(cluster).inc(n)
        self.v_gen_tokens.labels(self.model_name).inc(n)

    def on_finished(self, cluster: str, outcome: str, e2e: float) -> None:
        self._cluster(cluster)
        self.requests.labels(cluster, outcome if outcome in OUTCOMES else "error").inc()
        self.e2e.labels(cluster).observe(e2e)
        self.v_e2e.labels(self.model_name).observe(e2e)
        if outcome in VLLM_FINISH_REASONS:
            self.v_success.labels(self.model_name, outcome).inc()

    def on_request_done(
        self, cluster: str, outcome: str, metrics: RequestMetrics, prompt_tokens: int, max_tokens: int
    ) -> None:
        name, t = self.model_name, metrics
        self.v_req_prompt.labels(name).observe(prompt_tokens)
        self.v_req_gen.labels(name).observe(len(t.token_times))
        self.v_max_tokens.labels(name).observe(max_tokens)
        if t.first_scheduled_time is None:
            return
        self.v_queue.labels(name).observe(t.first_scheduled_time - t.arrival_time)
        if t.finish_time is not None:
            self.v_inference.labels(name).observe(t.finish_time - t.first_scheduled_time)
        if t.first_token_time is None:
            return
        self.v_prefill.labels(name).observe(t.first_token_time - t.first_scheduled_time)
        last = t.token_times[-1]
        self.v_decode.labels(name).observe(last - t.first_token_time)
        if len(t.token_times) > 1:
            self.v_tpot.labels(name).observe((last - t.first_token_time) / (len(t.token_times) - 1))

    def on_iteration(
        self, stats: IterationStats | None, waiting: dict[str, int], running: dict[str, int], kv_usage: float
    ) -> None:
        for name in self._clusters | set(waiting) | set(running):
            self._cluster(name)
            self.waiting.labels(name).set(waiting.get(name, 0))
            self.running.labels(name).set(running.get(name, 0))
        self.kv_usage.set(kv_usage)
        self.v_kv.labels(self.model_name).set(kv_usage)
        self.v_waiting.labels(self.model_name).set(sum(waiting.values()))
        self.v_running.labels(self.model_name).set(sum(running.values()))
        if stats is None:
            return
        self.iter_time.observe(stats.time_total)
        if stats.predicted_time is not None and stats.time_total > 0:
            self.iter_predicted.observe(stats.predicted_time)
            self.iter_ratio.observe(stats.predicted_time / stats.time_total)
            self.iter_limit.set(stats.time_limit or 0.0)
        if stats.cost_model_error is not None:
            self.cal_error.labels("0.5").set(stats.cost_model_error[0])
            self.cal_error.labels("0.95").set(stats.cost_model_error[1])
        self.iter_prefill.observe(stats.num_prefill_tokens)
        self.iter_decode.observe(stats.num_decode_tokens)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
            self.v_preemptions.labels(self.model_name).inc(stats.num_preempted)
        self.v_iter_tokens.labels(self.model_name).observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        p, d = stats.num_prefill_tokens, stats.num_decode_tokens
        kind = "hybrid" if p and d else ("prefill" if p else "decode")
        self.iterations.labels(kind).inc()
        self.cache_blocks.set(stats.num_cached_blocks)
        for cluster, queried, hit in stats.prefix_cache:
            self._cluster(cluster)
            self.cache_queries.labels(cluster).inc(queried)
            self.cache_hits.labels(cluster).inc(hit)
            self.v_cache_queries.labels(self.model_name).inc(queried)
            self.v_cache_hits.labels(self.model_name).inc(hit)
            totals = self._cache_totals.setdefault(cluster, [0, 0])
            totals[0] += queried
            totals[1] += hit
            self.cache_ratio.labels(cluster).set(totals[1] / totals[0] if totals[0] else 0.0)

    def on_config(self, config) -> None:
        self.budget.set(config.token_budget)
        self.time_target.set(config.time_target or 0.0)
        for c in config.clusters:
            self._cluster(c.name)
            self.chunk_cap.labels(c.name).set(c.chunk_cap or 0)
            self.max_waiting.labels(c.name).set(c.max_waiting or 0)
            self.max_running.labels(c.name).set(c.max_running or 0)
            if c.slo.ttft_p99 is not None:
                self.slo_ttft.labels(c.name).set(c.slo.ttft_p99)
            if c.slo.tbt_p99 is not None:
                self.slo_tbt.labels(c.name).set(c.slo.tbt_p99)

    def render(self) -> bytes:
        return generate_latest(self.registry)
