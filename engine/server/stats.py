"""A sliding window of recent per-cluster latencies and rates: the JSON behind GET /admin/v1/stats,
which the budget controller's local mode reads instead of Prometheus. Thread-safe."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stallfree.engine.outputs import IterationStats
from stallfree.engine.server.observer import EngineObserver

_SERIES = (
    "ttft", "tbt", "scheduling_delay", "e2e", "arrivals", "prompt_tokens", "admitted", "cache_queried", "cache_hit"
)  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def _ratio(hits: list[float], queries: list[float]) -> float | None:
    """Hit tokens over looked-up tokens in the window; None when nothing was looked up."""
    q = sum(queries)
    return sum(hits) / q if q > 0 else None


class WindowStats(EngineObserver):
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._series: dict[str, dict[str, deque[tuple[float, float]]]] = {}
        self._outcomes: dict[str, dict[str, int]] = {}
        self._rejections: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        self._running: dict[str, int] = {}
        self._kv_usage = 0.0
        self._cached_blocks = 0
        self._iterations: deque[tuple[float, int, int, float]] = deque()  # time, prefill, decode, seconds
        self._calibration: tuple[float, float] | None = None  # the engine's last cost-model error
        self.started = clock()

    # ---- observer ----------------------------------------------------------------------------------
    def _add(self, cluster: str, series: str, values: list[float] | float) -> None:
        now = self.clock()
        with self._lock:
            d = self._series.setdefault(cluster, {s: deque() for s in _SERIES})[series]
            for v in values if isinstance(values, list) else [values]:
                d.append((now, v))
            self._trim(d, now)

    def _trim(self, d: deque, now: float) -> None:
        cutoff = now - self.window_s
        while d and d[0][0] < cutoff:
            d.popleft()

    def on_arrival(self, cluster: str, prompt_tokens: int) -> None:
        self._add(cluster, "arrivals", 1.0)
        self._add(cluster, "prompt_tokens", float(prompt_tokens))

    def on_rejected(self, cluster: str, reason: str) -> None:
        with self._lock:
            self._rejections[cluster] = self._rejections.get(cluster, 0) + 1

    def on_scheduled(self, cluster: str, delay: float) -> None:
        self._add(cluster, "scheduling_delay", delay)
        self._add(cluster, "admitted", 1.0)

    def on_first_token(self, cluster: str, ttft: float) -> None:
        self._add(cluster, "ttft", ttft)

    def on_token_gaps(self, cluster: str, gaps: list[float]) -> None:
        self._add(cluster, "tbt", gaps)

    def on_finished(self, cluster: str, outcome: str, e2e: float) -> None:
        self._add(cluster, "e2e", e2e)
        with self._lock:
            o = self._outcomes.setdefault(cluster, {})
            o[outcome] = o.get(outcome, 0) + 1

    def on_iteration(
        self, stats: IterationStats | None, waiting: dict[str, int], running: dict[str, int], kv_usage: float
    ) -> None:
        for cluster, queried, hit in stats.prefix_cache if stats is not None else ():
            self._add(cluster, "cache_queried", float(queried))
            self._add(cluster, "cache_hit", float(hit))
        now = self.clock()
        with self._lock:
            self._waiting, self._running, self._kv_usage = waiting, running, kv_usage
            if stats is not None:
                self._cached_blocks = stats.num_cached_blocks
                self._iterations.append(
                    (now, stats.num_prefill_tokens, stats.num_decode_tokens, stats.time_total)
                )
                self._trim(self._iterations, now)
                if stats.cost_model_error is not None:
                    self._calibration = stats.cost_model_error

    # ---- reading -----------------------------------------------------------------------------------
    def admission_rate(self, cluster: str) -> float:
        """Requests per second leaving the cluster's waiting queue over the window."""
        with self._lock:
            d = self._series.get(cluster, {}).get("admitted")
            if not d:
                return 0.0
            self._trim(d, self.clock())
            return len(d) / self._span()

    def _span(self) -> float:
        return max(1e-3, min(self.window_s, self.clock() - self.started))

    def snapshot(self, config, waiting: dict[str, int], running: dict[str, int]) -> dict[str, Any]:
        """Per-cluster JSON: queue lengths, recent P50/P99 latencies, rates and current settings."""
        now = self.clock()
        span = self._span()
        out: dict[str, Any] = {}
        with self._lock:
            names = list(dict.fromkeys([*config.names, *self._series]))
            for name in names:
                series = self._series.get(name, {s: deque() for s in _SERIES})
                for d in series.values():
                    self._trim(d, now)
                vals = {k: [v for _, v in d] for k, d in series.items()}
                settings = config.cluster(name).to_json() if name in config.names else None
                out[name] = {
                    "waiting": waiting.get(name, 0),
                    "running": running.get(name, 0),
                    "ttftP50Seconds": percentile(vals["ttft"], 50),
                    "ttftP99Seconds": percentile(vals["ttft"], 99),
                    "tbtP50Seconds": percentile(vals["tbt"], 50),
                    "tbtP99Seconds": percentile(vals["tbt"], 99),
                    "schedulingDelayP50Seconds": percentile(vals["scheduling_delay"], 50),
                    "e2eP50Seconds": percentile(vals["e2e"], 50),
                    "arrivalRate": len(vals["arrivals"]) / span,
                    # NOTE: what prefill costs: prompt tokens less those served from the prefix cache
                    "prefillTokenRate": max(0.0, sum(vals["prompt_tokens"]) - sum(vals["cache_hit"])) / span,
                    "promptTokenRate": sum(vals["prompt_tokens"]) / span,
                    "prefixCacheHitRate": _ratio(vals["cache_hit"], vals["cache_queried"]),
                    "samples": {"ttft": len(vals["ttft"]), "tbt": len(vals["tbt"])},
                    "outcomes": dict(self._outcomes.get(name, {})),
                    "rejections": self._rejections.get(name, 0),
                    "settings": settings,
                }
            its = list(self._iterations)
            hits = [v for c in self._series.values() for _, v in c["cache_hit"]]
            queries = [v for c in self._series.values() for _, v in c["cache_queried"]]
            cached_blocks = self._cached_blocks
            calibration = self._calibration
        busy = sum(s for *_, s in its)
        return {
            "windowSeconds": self.window_s,
            "tokenBudget": config.token_budget,
            "timeTarget": config.time_target,
            "minTokenBudget": config.min_token_budget,
            "chunkAlign": config.chunk_align,
            # the cost model's calibration: |predicted / observed - 1| of the last iterations' times
            "costModelError": None
            if calibration is None
            else {"median": calibration[0], "p95": calibration[1]},
            "kvCacheUsage": self._kv_usage,
            "prefixCache": {"cachedBlocks": cached_blocks, "hitRate": _ratio(hits, queries)},
            "iterations": {
                "count": len(its),
                "prefillTokenRate": sum(p for _, p, _, _ in its) / span,
                "decodeTokenRate": sum(d for _, _, d, _ in its) / span,
                "busyFraction": min(1.0, busy / span),
            },
            "trafficClusters": out,
        }
