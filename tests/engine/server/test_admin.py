"""Admin API: auth, GET/PATCH config (applied from the next iteration, visible in metrics), stats; and the
metrics contract the budget controller, dashboards and alerts are written against."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}

METRIC_NAMES = [
    "stallfree_time_to_first_token_seconds", "stallfree_time_between_tokens_seconds",
    "stallfree_e2e_request_latency_seconds", "stallfree_scheduling_delay_seconds",
    "stallfree_iteration_duration_seconds", "stallfree_iteration_prefill_tokens",
    "stallfree_iteration_decode_tokens", "stallfree_requests_running", "stallfree_requests_waiting",
    "stallfree_kv_cache_usage_ratio", "stallfree_token_budget", "stallfree_chunk_cap_tokens",
    "stallfree_max_waiting", "stallfree_max_running", "stallfree_slo_ttft_p99_seconds",
    "stallfree_slo_tbt_p99_seconds", "stallfree_requests_total", "stallfree_request_arrivals_total",
    "stallfree_prompt_tokens_total", "stallfree_generation_tokens_total", "stallfree_preemptions_total",
    "stallfree_rejections_total", "stallfree_iterations_total", "vllm:num_requests_waiting",
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "stallfree_prefix_cache_query_tokens_total", "stallfree_prefix_cache_hit_tokens_total",
    "stallfree_prefix_cache_hit_ratio", "stallfree_prefix_cache_blocks",
]  # fmt: skip


def test_admin_needs_the_token(server, admin_headers):
    url = f"{server.url}/admin/v1/config"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.patch(url, json={"tokenBudget": 8}).status_code == 401
    assert httpx.get(url, headers=AUTH).status_code == 401, "the API key is not the admin token"
    assert httpx.get(url, headers=admin_headers).status_code == 200


def test_get_config_has_the_documented_shape(server, admin_headers):
    doc = httpx.get(f"{server.url}/admin/v1/config", headers=admin_headers).json()
    assert doc["tokenBudget"] == 256 and doc["chunkAlign"] == 0
    chat = doc["trafficClusters"]["chat"]
    assert chat["chunkCap"] == 128 and chat["maxWaiting"] == 64 and chat["priority"] == 1
    assert chat["slo"] == {"ttftP99Seconds": 2.0, "tbtP99Seconds": 0.5}
    assert set(doc["trafficClusters"]) == {"chat", "summarize", "default"}


@pytest.mark.parametrize(
    ("patch", "status", "words"),
    [
        ({"tokenBudget": 0}, 400, "tokenBudget"),
        ({"tokenBudget": "big"}, 400, "tokenBudget"),
        ({"trafficClusters": {"chat": {"chunkCap": -1}}}, 400, "trafficClusters.chat.chunkCap"),
        ({"trafficClusters": {"chat": {"slo": {"tbtP99Seconds": 0}}}}, 400, "tbtP99Seconds"),
        ({"trafficClusters": {"nope": {"chunkCap": 8}}}, 404, "nope"),
        ({"budget": 8}, 400, "unknown field budget"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_bad_admin_values_are_refused(server, admin_headers, patch, status, words):
    r = httpx.patch(f"{server.url}/admin/v1/config", headers=admin_headers, json=patch)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/admin/v1/config", headers=admin_headers).json()["tokenBudget"] == 256


def test_patch_budget_applies_to_the_next_iterations(default_model, admin_headers):
    s = start_server(default_model, traffic={"tokenBudget": 512})
    try:
        url = f"{s.url}/admin/v1/config"
        r = httpx.patch(url, headers=admin_headers,
                        json={"tokenBudget": 32, "trafficClusters": {"default": {"chunkCap": 16, "maxWaiting": 5}}})  # fmt: skip
        assert r.status_code == 200 and r.json()["tokenBudget"] == 32
        assert r.json()["trafficClusters"]["default"]["chunkCap"] == 16
        assert s.metric("stallfree_token_budget") == 32
        assert s.metric("stallfree_chunk_cap_tokens", traffic_cluster="default") == 16
        assert s.metric("stallfree_max_waiting", traffic_cluster="default") == 5
        count0 = s.metric("stallfree_iteration_prefill_tokens_count")
        le16 = s.metric("stallfree_iteration_prefill_tokens_bucket", le="16.0")
        prompt = "word " * 120
        out = httpx.post(
            f"{s.url}/v1/completions", headers=AUTH, json={"prompt": prompt, "max_tokens": 2}, timeout=60
        )
        assert out.status_code == 200
        n_iters = s.metric("stallfree_iteration_prefill_tokens_count") - count0
        assert n_iters >= 120 / 16, "the prompt should have been prefilled in chunks of at most 16"
        assert s.metric("stallfree_iteration_prefill_tokens_bucket", le="16.0") - le16 == n_iters
        assert s.engine.tunables.token_budget == 32
    finally:
        s.stop()


def test_stats_snapshot(server, admin_headers, client):
    client.completions.create(model=None, prompt="Hello there", max_tokens=4,
                              extra_headers={"x-traffic-cluster": "chat"})  # fmt: skip
    stats = httpx.get(f"{server.url}/admin/v1/stats", headers=admin_headers).json()
    chat = stats["trafficClusters"]["chat"]
    assert chat["ttftP99Seconds"] > 0 and chat["tbtP99Seconds"] > 0 and chat["arrivalRate"] > 0
    assert chat["prefillTokenRate"] > 0 and chat["settings"]["chunkCap"] == 128
    assert {"waiting", "running", "ttftP50Seconds", "tbtP50Seconds", "schedulingDelayP50Seconds"} <= set(chat)
    assert stats["tokenBudget"] == 256


def test_admin_disabled_without_token_unless_local(default_model):
    s = start_server(default_model, admin_token=None, settings_host="0.0.0.0")
    try:
        r = httpx.get(f"{s.url}/admin/v1/config")
        assert r.status_code == 403 and "STALLFREE_ADMIN_TOKEN" in r.json()["error"]["message"]
    finally:
        s.stop()
    s = start_server(default_model, admin_token=None, settings_host="127.0.0.1")
    try:
        assert httpx.get(f"{s.url}/admin/v1/config").status_code == 200
    finally:
        s.stop()


def test_every_contract_metric_is_exported(server, client):
    client.completions.create(model=None, prompt="Hi", max_tokens=2)
    text = server.metrics()
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in text, f"{name} is missing from /metrics"
    assert 'stallfree_requests_total{outcome="length",traffic_cluster="default"}' in text
    assert 'vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"}' in text
    assert server.metric("stallfree_slo_tbt_p99_seconds", traffic_cluster="chat") == 0.5
