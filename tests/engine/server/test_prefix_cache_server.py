"""Prefix caching over real HTTP with the openai client: usage.prompt_tokens_details.cached_tokens, the
metrics (vLLM's token counters and a per-cluster hit ratio), /admin/v1/stats, and the reset action."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from server_helpers import ADMIN, API_KEY, start_server, wait_for

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a careful assistant. Answer briefly and cite the rule you use. " * 12


@pytest.fixture(scope="module")
def cached_server(default_model):
    s = start_server(
        default_model, traffic={"trafficClusters": [{"name": "chat", "match": {"header": "chat"}}]}
    )
    yield s
    s.stop()


def client_for(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client: OpenAI, question: str, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=3,
        temperature=0,
        **kw,
    )


def test_second_request_with_the_same_system_prompt_reports_cached_tokens(cached_server):
    client = client_for(cached_server)
    first = chat(client, "What is 2 + 2?", extra_headers={"x-traffic-cluster": "chat"})
    second = chat(client, "Name a colour.", extra_headers={"x-traffic-cluster": "chat"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 160 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    # the same on completions with token ids, and in the streamed usage chunk
    ids = list(range(1000, 1100))
    client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    chunks = list(client.completions.create(model=MODEL, prompt=ids + [5], max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 96

    s = cached_server
    assert wait_for(
        lambda: s.metric("vllm:prefix_cache_hits_total", model_name="SmolLM2-135M-Instruct") >= cached + 96
    )
    queries = s.metric("vllm:prefix_cache_queries_total", model_name="SmolLM2-135M-Instruct")
    assert queries >= first.usage.prompt_tokens + second.usage.prompt_tokens + 201
    ratio = s.metric("stallfree_prefix_cache_hit_ratio", traffic_cluster="chat")
    assert 0.3 < ratio < 0.6  # one of two chat prompts, most of it cached
    assert s.metric("stallfree_prefix_cache_hit_tokens_total", traffic_cluster="chat") == cached
    assert s.metric("stallfree_prefix_cache_blocks") >= 16

    stats = httpx.get(f"{s.url}/admin/v1/stats", headers=ADMIN_AUTH).json()
    assert stats["prefixCache"]["cachedBlocks"] >= 16
    assert 0 < stats["prefixCache"]["hitRate"] < 1
    chat_stats = stats["trafficClusters"]["chat"]
    assert chat_stats["prefixCacheHitRate"] == pytest.approx(ratio)
    # the controller's feed-forward sees what prefill costs: prompt tokens less the cached ones
    assert chat_stats["prefillTokenRate"] < chat_stats["promptTokenRate"]


def test_reset_needs_the_admin_token_and_empties_the_cache(cached_server):
    s, client = cached_server, client_for(cached_server)
    chat(client, "Warm it up.")
    url = f"{s.url}/admin/v1/reset_prefix_cache"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
    r = httpx.post(url, headers=ADMIN_AUTH)
    assert r.status_code == 200 and r.json()["droppedBlocks"] >= 10
    assert chat(client, "After the reset.").usage.prompt_tokens_details.cached_tokens == 0
    assert chat(client, "And again.").usage.prompt_tokens_details.cached_tokens > 0


def test_caching_off_reports_no_cached_tokens(default_model):
    s = start_server(default_model, enable_prefix_caching=False)
    try:
        client = client_for(s)
        chat(client, "One.")
        assert chat(client, "Two.").usage.prompt_tokens_details.cached_tokens == 0
        assert s.metric("vllm:prefix_cache_hits_total", model_name="SmolLM2-135M-Instruct") == 0
    finally:
        s.stop()
