"""PromQL the controller reads, as pure functions of a label selector and a window.

One place for the queries, so the controller, the Grafana dashboard and the alert tests agree on names.
`selector` is the inside of a label matcher, e.g. `namespace="llm",deployment="smollm2"` or `job="stallfree"`;
empty selects every engine.
"""

from __future__ import annotations

BY_CLUSTER = "traffic_cluster"
BY_REPLICA = "instance, traffic_cluster"


def _sel(selector: str) -> str:
    return "{" + selector + "}" if selector else ""


def window(seconds: float) -> str:
    """A PromQL range, whole seconds, at least 1s."""
    return f"{max(1, round(seconds))}s"


def quantile(q: float, histogram: str, selector: str, w: str, by: str = BY_CLUSTER) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{_sel(selector)}[{w}])))"


def rate_by(counter: str, selector: str, w: str, by: str = BY_CLUSTER) -> str:
    return f"sum by ({by}) (rate({counter}{_sel(selector)}[{w}]))"


def gauge_by(gauge: str, selector: str, by: str = BY_CLUSTER) -> str:
    return f"sum by ({by}) ({gauge}{_sel(selector)})"


def uncached_prompt_rate(selector: str, w: str) -> str:
    """Prompt tokens per second that need prefill: arriving ones less those served from the prefix cache
    (an engine without the hit counter counts as no hits)."""
    prompt = rate_by("stallfree_prompt_tokens_total", selector, w)
    hits = rate_by("stallfree_prefix_cache_hit_tokens_total", selector, w)
    return f"clamp_min({prompt} - ({hits} or {prompt} * 0), 0)"


def cluster_queries(selector: str, window_s: float) -> dict[str, str]:
    """Per-traffic-cluster signals of a ClusterSnapshot, keyed by its field names."""
    w = window(window_s)
    return {
        "tbt_p99": quantile(0.99, "stallfree_time_between_tokens_seconds", selector, w),
        "ttft_p99": quantile(0.99, "stallfree_time_to_first_token_seconds", selector, w),
        "scheduling_delay_p50": quantile(0.5, "stallfree_scheduling_delay_seconds", selector, w),
        "waiting": gauge_by("stallfree_requests_waiting", selector),
        "waiting_trend": f"sum by ({BY_CLUSTER}) (deriv(stallfree_requests_waiting{_sel(selector)}[{w}]))",
        "running": gauge_by("stallfree_requests_running", selector),
        "arrival_rate": rate_by("stallfree_request_arrivals_total", selector, w),
        "prefill_token_rate": uncached_prompt_rate(selector, w),
        "prompt_token_rate": rate_by("stallfree_prompt_tokens_total", selector, w),
        "rejection_rate": rate_by("stallfree_rejections_total", selector, w),
    }


def replica_queries(selector: str, window_s: float) -> dict[str, str]:
    """Per replica and cluster P99s, for the status document (a single slow replica shows up here)."""
    w = window(window_s)
    return {
        "tbt_p99": quantile(0.99, "stallfree_time_between_tokens_seconds", selector, w, BY_REPLICA),
        "ttft_p99": quantile(0.99, "stallfree_time_to_first_token_seconds", selector, w, BY_REPLICA),
    }


def fleet_queries(selector: str) -> dict[str, str]:
    """Fleet-wide health: how many engines report, how fresh the newest sample is, KV usage, and the
    engines' cost-model calibration (the worst engine's P95 of |predicted / observed - 1|)."""
    s = _sel(selector)
    p95 = _sel(",".join(m for m in ('quantile="0.95"', selector) if m))
    return {
        "replicas": f"count(stallfree_token_budget{s})",
        "age": f"max(time() - timestamp(stallfree_token_budget{s}))",
        "kv_cache_usage": f"avg(stallfree_kv_cache_usage_ratio{s})",
        "cost_model_error": f"max(stallfree_cost_model_error_ratio{p95})",
    }
