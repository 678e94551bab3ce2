"""vLLM's metric names on /metrics, with values that follow the requests served (what gateways' endpoint
pickers, KEDA scalers and vLLM dashboards read)."""

from __future__ import annotations

import re

M = {"model_name": "SmolLM2-135M-Instruct"}
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
]
COUNTERS = [
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]


def snapshot(server) -> dict[str, float]:
    out = {}
    for name in COUNTERS + GAUGES:
        out[name] = server.metric(name, **M)
    for name in HISTOGRAMS:
        out[name] = server.metric(f"{name}_count", **M)
        out[name + ":sum"] = server.metric(f"{name}_sum", **M)
    for reason in ("stop", "length", "abort"):
        out[reason] = server.metric("vllm:request_success_total", **M, finished_reason=reason)
    return out


def test_every_vllm_name_is_exported_with_vllm_buckets(server):
    text = server.metrics()
    kinds = {"histogram": HISTOGRAMS, "counter": COUNTERS + ["vllm:request_success_total"], "gauge": GAUGES}
    for kind, names in kinds.items():
        for name in names:
            assert f"# TYPE {name} {kind}\n" in text, name
    # vLLM's bucket edges, e.g. the e2e latency histogram's 0.3 s / 7680 s and TTFT's 2560 s
    assert re.search(r'vllm:e2e_request_latency_seconds_bucket\{[^}]*le="0.3"', text)
    assert re.search(r'vllm:e2e_request_latency_seconds_bucket\{[^}]*le="7680.0"', text)
    assert re.search(r'vllm:time_to_first_token_seconds_bucket\{[^}]*le="2560.0"', text)


def test_vllm_metrics_follow_the_requests(client, server):
    before = snapshot(server)
    prompt = "The capital of France is"
    r = client.completions.create(
        model=None, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = snapshot(server)
    d = {k: after[k] - before[k] for k in after}
    assert d["vllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert d["vllm:generation_tokens_total"] == 6
    assert d["length"] == 1 and d["stop"] == 0
    for name in HISTOGRAMS:
        if name in ("vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total"):
            assert d[name] >= 5, name  # one per gap / per iteration
        else:
            assert d[name] == 1, name  # one per request
    assert d["vllm:request_prompt_tokens:sum"] == r.usage.prompt_tokens
    assert d["vllm:request_generation_tokens:sum"] == 6
    assert d["vllm:request_params_max_tokens:sum"] == 6
    assert d["vllm:iteration_tokens_total:sum"] >= r.usage.prompt_tokens + 5
    # the request's timeline adds up: queue + inference = e2e (the same clock readings)
    e2e = d["vllm:e2e_request_latency_seconds:sum"]
    parts = d["vllm:request_queue_time_seconds:sum"] + d["vllm:request_inference_time_seconds:sum"]
    assert abs(e2e - parts) < 1e-6 + 0.01 * e2e
    assert d["vllm:request_decode_time_seconds:sum"] <= d["vllm:request_inference_time_seconds:sum"]
