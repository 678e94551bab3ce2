"""The open-loop load generator: replay a workload against any OpenAI-compatible /v1/completions endpoint.

Each request is sent at its arrival time whether or not earlier ones have finished (open loop), as a
streaming completion whose prompt is a list of token ids of the trace's length, with `max_tokens` = the
trace's output length and `ignore_eos` so the length is fixed. `logprobs: 0` makes the server send one
chunk per token even when a token's text is empty, so every inter-token gap is seen. Times are taken on
arrival of each SSE chunk.

Server-side figures (scheduling delay, iteration times) come from Prometheus text at /metrics when the
server has it: the histogram buckets are read before and after the run and the quantiles are taken from
their difference, as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from stallfree.bench.metrics import ERROR, OK, REJECTED, TIMEOUT, RequestRecord
from stallfree.bench.traces import Workload

if TYPE_CHECKING:
    from stallfree.bench.textprompts import TextPrompts

logger = logging.getLogger(__name__)

SERVER_HISTOGRAMS = {
    "scheduling_delay_s": "stallfree_scheduling_delay_seconds",
    "ttft_s": "stallfree_time_to_first_token_seconds",
    "tbt_s": "stallfree_time_between_tokens_seconds",
    "iteration_s": "stallfree_iteration_duration_seconds",
}
SERVER_COUNTERS = {
    "preemptions": "stallfree_preemptions_total",
    "rejections": "stallfree_rejections_total",
    "iterations": "stallfree_iterations_total",
    "prefix_cache_query_tokens": "stallfree_prefix_cache_query_tokens_total",
    "prefix_cache_hit_tokens": "stallfree_prefix_cache_hit_tokens_total",
}


async def fetch_model_id(client: httpx.AsyncClient, base: str) -> str:
    r = await client.get(f"{base}/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model: give --model")
    return data[0]["id"]


async def _one(
    client: httpx.AsyncClient,
    base: str,
    body: dict,
    rec: RequestRecord,
    t0: float,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> None:
    rec.sent = time.perf_counter() - t0
    try:
        await asyncio.wait_for(_stream(client, base, body, rec, t0, headers), timeout)
    except asyncio.TimeoutError:
        rec.outcome, rec.error = TIMEOUT, f"no answer within {timeout:g} s"
        rec.finish = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.outcome, rec.error = ERROR, f"{type(e).__name__}: {e}"[:300]
        rec.finish = time.perf_counter() - t0


async def _stream(
    client: httpx.AsyncClient,
    base: str,
    body: dict,
    rec: RequestRecord,
    t0: float,
    headers: dict[str, str] | None = None,
) -> None:
    async with client.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as resp:
        rec.status_code = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            rec.outcome = REJECTED if resp.status_code == 429 else ERROR
            rec.error = f"HTTP {resp.status_code}: {text}"
            rec.finish = time.perf_counter() - t0
            return
        usage_tokens = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            chunk = json.loads(data)
            if "error" in chunk:
                rec.outcome, rec.error, rec.finish = ERROR, str(chunk["error"])[:300], now
                return
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                lp = choice.get("logprobs") or {}
                n = len(lp.get("tokens") or []) or (1 if choice.get("text") else 0)
                if n == 0:
                    continue  # a final chunk carrying only the finish reason
                if rec.first_token is None:
                    rec.first_token = now
                rec.token_times.append(now)
                rec.output_tokens += n
        rec.finish = time.perf_counter() - t0
        if usage_tokens is not None:
            rec.output_tokens = usage_tokens
        if rec.first_token is not None:
            rec.outcome = OK
        else:
            rec.outcome, rec.error = ERROR, "the stream ended without a token"


def request_body(model: str, ids: list[int], max_tokens: int, logprobs: bool = True) -> dict:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs:
        body["logprobs"] = 0
    return body


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    logprobs: bool = True,
    traffic_cluster: str | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    text_prompts: TextPrompts | None = None,
) -> list[RequestRecord]:
    """Send every request of the workload at its arrival time; return one record per request, in order.

    `traffic_cluster` is sent as the x-traffic-cluster header (stallfree's traffic clusters); a request's
    own `TraceRequest.traffic_cluster`, when set, replaces it for that request. With `text_prompts` the
    prompts go as text of the same token length (for servers that refuse token ids)."""
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if traffic_cluster:
        headers["x-traffic-cluster"] = traffic_cluster
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        model = model or await fetch_model_id(client, base)
        bodies = [
            request_body(model, r.token_ids(workload.seed), r.output_tokens, logprobs)
            for r in workload.requests
        ]
        if text_prompts is not None:  # servers that take only strings (see stallfree.bench.textprompts)
            bodies = [
                text_prompts.body(b, r.index, r.prompt_tokens, workload.seed)
                for b, r in zip(bodies, workload.requests, strict=True)
            ]
        records = [
            RequestRecord(r.index, r.prompt_tokens, r.output_tokens, r.arrival) for r in workload.requests
        ]
        t0 = time.perf_counter()

        async def fire(i: int) -> None:
            delay = workload.requests[i].arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            own = workload.requests[i].traffic_cluster
            headers = {"x-traffic-cluster": own} if own else None
            await _one(client, base, bodies[i], records[i], t0, timeout, headers)
            if on_done is not None:
                on_done(records[i])

        await asyncio.gather(*(fire(i) for i in range(len(records))))
    return records


# ---- server metrics ---------------------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, dict]:
    """{histogram base name: {le: cumulative count}} and {counter name: value}, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    hist: dict[str, dict[float, float]] = {}
    counters: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                le = float(s.labels["le"])
                h = hist.setdefault(s.name[: -len("_bucket")], {})
                h[le] = h.get(le, 0.0) + s.value
            elif s.name.endswith("_total"):
                counters[s.name] = counters.get(s.name, 0.0) + s.value
    return {"histograms": hist, "counters": counters}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets {upper bound: count}."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    total = items[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def metrics_delta(before: dict, after: dict) -> dict:
    """Server-side quantiles and counts for what happened between two scrapes."""
    out: dict = {}
    for key, name in SERVER_HISTOGRAMS.items():
        a = after["histograms"].get(name)
        if a is None:
            continue
        b = before["histograms"].get(name, {})
        delta = {le: c - b.get(le, 0.0) for le, c in a.items()}
        out[key] = {
            "count": max(delta.values()) if delta else 0,
            **{f"p{q}": histogram_quantile(q / 100, delta) for q in (50, 95, 99)},
        }
    for key, name in SERVER_COUNTERS.items():
        if name in after["counters"]:
            out[key] = after["counters"][name] - before["counters"].get(name, 0.0)
    return out


async def scrape(base_url: str) -> dict | None:
    """The parsed /metrics of the server, or None when it has none (a peer server)."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as c:
            r = await c.get(f"{base_url.rstrip('/')}/metrics")
        if r.status_code != 200 or "# TYPE" not in r.text:
            return None
        return parse_prometheus(r.text)
    except (httpx.HTTPError, ValueError) as e:
        logger.info("no server metrics at %s: %s", base_url, e)
        return None
