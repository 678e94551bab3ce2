"""Metrics and settings straight from the engines' admin API (local mode without Prometheus).

StatsSource turns every engine's GET /admin/v1/stats into one Snapshot (worst P99s over replicas, summed
queues and rates); read_settings reads what an engine runs (GET /admin/v1/config). Settings go the other
way through applier.EngineApplier, the operator's applier too. Plain HTTP (httpx).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import httpx

from stallfree.operator.controller.prometheus import MetricsUnavailable
from stallfree.operator.controller.types import ClusterSnapshot, Knobs, Settings, Snapshot

log = logging.getLogger(__name__)

Endpoints = Callable[[], Sequence[str]]  # base URLs of the engines that should be up now


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class StatsSource:
    """Reads /admin/v1/stats of every engine. The engines' own sliding window (--stats-window) is the
    metrics window; `window_s` is ignored."""

    def __init__(self, endpoints: Endpoints, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.endpoints = endpoints
        self.token = token
        self.timeout_s = timeout_s
        self._last_waiting: dict[str, tuple[float, float]] = {}
        self.last_raw: dict[str, dict] = {}

    def fetch(self, base: str) -> dict:
        r = httpx.get(f"{base}/admin/v1/stats", headers=_headers(self.token), timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()

    def snapshot(self, window_s: float, clusters: list[str]) -> Snapshot:
        raws: dict[str, dict] = {}
        errors = []
        for base in self.endpoints():
            try:
                raws[base] = self.fetch(base)
            except (httpx.HTTPError, ValueError) as e:
                errors.append(f"{base}: {e}")
        if not raws:
            why = "; ".join(errors) if errors else "no engine is running"
            raise MetricsUnavailable(f"no engine answered /admin/v1/stats ({why})")
        self.last_raw = raws
        now = time.monotonic()
        snaps = {}
        kv = []
        for name in clusters:
            acc: dict = {"waiting": 0.0, "running": 0.0, "arrival_rate": 0.0, "prefill_token_rate": 0.0}
            tbt = ttft = delay = None
            rejections = prompt_rate = 0.0
            for raw in raws.values():
                c = (raw.get("trafficClusters") or {}).get(name) or {}
                # prefillTokenRate is what needs prefill (uncached); the context is the whole prompt
                prompt_rate += float(c.get("promptTokenRate", c.get("prefillTokenRate")) or 0.0)
                tbt = _max(tbt, c.get("tbtP99Seconds"))
                ttft = _max(ttft, c.get("ttftP99Seconds"))
                delay = _max(delay, c.get("schedulingDelayP50Seconds"))
                for key, field in (
                    ("waiting", "waiting"),
                    ("running", "running"),
                    ("arrivalRate", "arrival_rate"),
                    ("prefillTokenRate", "prefill_token_rate"),
                ):
                    acc[field] += float(c.get(key) or 0.0)
                rejections += float(c.get("rejections") or 0)
            prev = self._last_waiting.get(name)
            trend = (acc["waiting"] - prev[1]) / (now - prev[0]) if prev and now > prev[0] else 0.0
            self._last_waiting[name] = (now, acc["waiting"])
            prev_rej = self._last_waiting.get(name + "\0rej")
            rej_rate = (
                (rejections - prev_rej[1]) / (now - prev_rej[0]) if prev_rej and now > prev_rej[0] else 0.0
            )
            self._last_waiting[name + "\0rej"] = (now, rejections)
            ctx = prompt_rate / acc["arrival_rate"] if acc["arrival_rate"] > 0 else 0.0
            snaps[name] = ClusterSnapshot(
                name=name,
                tbt_p99=tbt,
                ttft_p99=ttft,
                scheduling_delay_p50=delay,
                waiting_trend=trend,
                rejection_rate=max(rej_rate, 0.0),
                mean_context=ctx,
                **acc,
            )
        for raw in raws.values():
            if raw.get("kvCacheUsage") is not None:
                kv.append(float(raw["kvCacheUsage"]))
        # the worst engine's calibration: P95 of |predicted / observed - 1| of its last iterations
        errors_p95 = [float(cal["p95"]) for raw in raws.values() if (cal := raw.get("costModelError"))]
        return Snapshot(
            time=time.time(),
            clusters=snaps,
            replicas_seen=len(raws),
            kv_cache_usage=sum(kv) / len(kv) if kv else None,
            cost_model_error=max(errors_p95) if errors_p95 else None,
        )


def read_settings(base: str, token: str | None, replicas: int, timeout_s: float = 5.0) -> Settings:
    """The settings an engine runs with now (GET /admin/v1/config): how a restarted controller adopts them."""
    r = httpx.get(f"{base}/admin/v1/config", headers=_headers(token), timeout=timeout_s)
    r.raise_for_status()
    doc = r.json()
    clusters = {
        name: Knobs(c.get("chunkCap"), c.get("maxWaiting"), c.get("maxRunning"))
        for name, c in (doc.get("trafficClusters") or {}).items()
    }
    target = doc.get("timeTarget")
    return Settings(
        token_budget=int(doc["tokenBudget"]),
        replicas=replicas,
        clusters=clusters,
        time_target=None if target is None else float(target),
    )
