"""Reads a Snapshot from Prometheus (prometheus-api-client). Never guesses: any failure raises
MetricsUnavailable and the loop holds the last good settings."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from stallfree.operator.controller import promql
from stallfree.operator.controller.types import ClusterSnapshot, Snapshot

log = logging.getLogger(__name__)


class MetricsUnavailable(RuntimeError):
    """The metrics needed for a decision could not be read, or are stale. The message says which."""


@dataclass(frozen=True, slots=True)
class ReplicaReading:
    instance: str
    cluster: str
    tbt_p99: float | None
    ttft_p99: float | None


def _num(value: object) -> float | None:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


class PrometheusSource:
    """Snapshots of one engine fleet (`selector`) from the Prometheus at `url`."""

    def __init__(
        self,
        url: str,
        selector: str = "",
        *,
        timeout_s: float = 5.0,
        max_age_s: float = 60.0,
    ) -> None:
        from prometheus_api_client import PrometheusConnect  # lazy: `--help` stays fast
        from urllib3.util.retry import Retry

        self.url = url.rstrip("/")
        self.selector = selector
        self.max_age_s = max_age_s
        self._timeout = timeout_s
        # One quick retry for a refused connection or a gateway error, none for a read that timed out: the
        # client's default (3 retries, 1 s backoff) held a step 21 s on a hung Prometheus, not timeout_s.
        retry = Retry(total=1, read=0, backoff_factor=0.2, status_forcelist=(502, 503, 504))
        self._prom = PrometheusConnect(
            url=self.url, disable_ssl=True, timeout=int(max(1, timeout_s)), retry=retry
        )
        self.last_replicas: list[ReplicaReading] = []

    def query(self, expr: str) -> list[dict]:
        """One instant query; MetricsUnavailable on any transport or PromQL error."""
        from prometheus_api_client import PrometheusApiClientException
        from requests import RequestException

        try:
            return self._prom.custom_query(expr, timeout=int(max(1, self._timeout)))
        except (PrometheusApiClientException, RequestException, ValueError) as e:
            raise MetricsUnavailable(f"Prometheus at {self.url} did not answer {expr!r}: {e}") from e

    def _scalar(self, expr: str) -> float | None:
        rows = self.query(expr)
        return _num(rows[0]["value"][1]) if rows else None

    def snapshot(self, window_s: float, clusters: list[str]) -> Snapshot:
        """Read every signal over the last `window_s` seconds. Raises MetricsUnavailable when no engine
        reports or the newest sample is older than max_age_s."""
        fleet = promql.fleet_queries(self.selector)
        seen = self._scalar(fleet["replicas"])
        if not seen:
            raise MetricsUnavailable(f"no engine metrics in Prometheus at {self.url} for {{{self.selector}}}")
        age = self._scalar(fleet["age"])
        if age is None or age > self.max_age_s:
            raise MetricsUnavailable(
                f"engine metrics are stale: newest sample {age}s old (limit {self.max_age_s}s)"
            )
        values: dict[str, dict[str, float]] = {c: {} for c in clusters}
        for field, expr in promql.cluster_queries(self.selector, window_s).items():
            for row in self.query(expr):
                name = row["metric"].get(promql.BY_CLUSTER)
                if name in values and (v := _num(row["value"][1])) is not None:
                    values[name][field] = v
        snaps = {}
        for name, signals in values.items():
            # NOTE: the context (attention) is the whole prompt; the prefill work only its uncached part
            prompt = signals.pop("prompt_token_rate", signals.get("prefill_token_rate", 0.0))
            arrivals = signals.get("arrival_rate", 0.0)
            snaps[name] = ClusterSnapshot(
                name=name, mean_context=prompt / arrivals if arrivals > 0 else 0.0, **signals
            )
        self.last_replicas = self._replicas(window_s)
        return Snapshot(
            time=time.time(),
            clusters=snaps,
            replicas_seen=int(seen),
            kv_cache_usage=self._scalar(fleet["kv_cache_usage"]),
            cost_model_error=self._scalar(fleet["cost_model_error"]),
        )

    def _replicas(self, window_s: float) -> list[ReplicaReading]:
        got: dict[tuple[str, str], dict[str, float | None]] = {}
        for field, expr in promql.replica_queries(self.selector, window_s).items():
            for row in self.query(expr):
                key = (row["metric"].get("instance", ""), row["metric"].get(promql.BY_CLUSTER, ""))
                got.setdefault(key, {})[field] = _num(row["value"][1])
        return [
            ReplicaReading(instance=i, cluster=c, tbt_p99=v.get("tbt_p99"), ttft_p99=v.get("ttft_p99"))
            for (i, c), v in sorted(got.items())
        ]
