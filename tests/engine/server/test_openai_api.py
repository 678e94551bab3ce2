"""The OpenAI API through the real `openai` SDK against a real server: completions, chat, streaming,
usage, stop strings, seeds, logprobs, token-id prompts, and 32 concurrent streaming clients."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI
from server_helpers import API_KEY

from stallfree.engine import LLM, SamplingParams

PROMPT = "The capital of France is"
MODEL = "SmolLM2-135M-Instruct"


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_offline_greedy(client, default_model):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    ref = LLM(loaded_model=default_model, num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )[0]
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.object == "text_completion" and out.id.startswith("cmpl-")


def test_streamed_completion_arrives_incrementally_and_equals_the_whole(client):
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) >= 3, "tokens should arrive in several chunks"
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert whole.usage.completion_tokens == 10


def test_chat_and_streamed_chat_agree(client):
    msgs = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 8
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_cut_the_output(client):
    base = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    assert stop not in out.choices[0].text


def test_token_id_prompt_seed_and_logprobs(client, default_model):
    ids = default_model.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    a, b = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text, "the same seed must give the same sample"
    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lps = lp.choices[0].logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == lp.usage.completion_tokens
    assert all(x <= 0 for x in lps.token_logprobs) and all(len(t) == 3 for t in lps.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 2


def test_min_tokens_and_ignore_eos_fix_output_length(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 12},
    )
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"


def test_traffic_cluster_header_and_length_rules(client, server):
    before = server.metric("stallfree_request_arrivals_total", traffic_cluster="chat")
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"x-traffic-cluster": "chat"}
    )
    assert server.metric("stallfree_request_arrivals_total", traffic_cluster="chat") == before + 1
    long_prompt = " ".join(["token"] * 260)
    before = server.metric("stallfree_request_arrivals_total", traffic_cluster="summarize")
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert server.metric("stallfree_request_arrivals_total", traffic_cluster="summarize") == before + 1


async def test_32_concurrent_streaming_clients(server, default_model):
    prompts = [
        f"Question {i}: name a color that starts with the letter {chr(65 + i % 26)}." for i in range(32)
    ]
    llm = LLM(loaded_model=default_model, num_kv_blocks=256, max_num_seqs=64, token_budget=256)
    expected = [
        o.text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    ]
    hybrid_before = server.metric("stallfree_iterations_total", kind="hybrid")

    async def one(client: AsyncOpenAI, i: int) -> tuple[str, int]:
        await asyncio.sleep(0.02 * i)  # staggered arrivals: later prompts join running decodes
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0, stream=True
        )
        parts = [c.choices[0].text async for c in stream if c.choices]
        return "".join(parts), len([p for p in parts if p])

    async with AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)),
    ) as client:  # fmt: skip
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
    assert [t for t, _ in results] == expected
    assert all(n >= 1 for (_, n), e in zip(results, expected, strict=True) if e)
    assert server.metric("stallfree_iterations_total", kind="hybrid") > hybrid_before, (
        "some iteration should mix prefill chunks with decodes"
    )
