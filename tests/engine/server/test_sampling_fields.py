"""n > 1, penalties, logit_bias and continuous usage stats through the real server and the openai SDK."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import API_KEY

PROMPT = "Count: 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1,"


@pytest.fixture(scope="module")
def token_ids(default_model):
    """token string -> id, for the strings that only one id decodes to (logprobs come back as strings)."""
    tok = default_model.tokenizer
    seen: dict[str, list[int]] = {}
    for i in range(tok.vocab_size):
        seen.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    return {s: ids[0] for s, ids in seen.items() if len(ids) == 1}


@pytest.fixture(scope="module")
def encode(server):
    """The server's own tokenisation of a text prompt."""
    return server.engine.tokenizer.encode


def test_n_choices_share_the_prompt_and_sum_the_usage(client, server):
    hits_before = server.metric("stallfree_prefix_cache_hit_tokens_total", traffic_cluster="default")
    kw = {"model": None, "prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11}
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds seed, seed + 1, seed + 2
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))  # counted once
    assert r.usage.completion_tokens == 8 * 3
    # The later choices took the prompt's full blocks from the prefix cache instead of prefilling them.
    full_blocks = (r.usage.prompt_tokens - 1) // server.engine.block_manager.block_size
    hits = server.metric("stallfree_prefix_cache_hit_tokens_total", traffic_cluster="default") - hits_before
    assert hits >= 2 * full_blocks * server.engine.block_manager.block_size
    again = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_greedy_n_gives_n_copies_of_the_one_answer(client):
    one = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=10, temperature=0)  # fmt: skip
    three = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=10, temperature=0, n=3)  # fmt: skip
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens


def test_streamed_n_interleaves_choices_that_equal_the_whole(client):
    kw = {"model": None, "prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 0.9, "seed": 5}
    whole = client.completions.create(**kw)
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    order = []
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            order.append(c.index)
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.text for c in whole.choices]
    assert all(f in ("stop", "length") for f in finishes)
    assert len(set(order[:6])) > 1  # interleaved, not one choice after the other
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_n_opens_each_choice_with_its_role(client):
    roles, content = {}, ["", ""]
    stream = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, n=2, temperature=0, stream=True)  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            content[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert content[0] == content[1] != ""


def test_continuous_usage_stats_put_usage_in_every_chunk(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 3
    assert all(c["usage"] is not None for c in chunks)
    prompt = chunks[0]["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == prompt + 6


def _top(choice_logprobs, step: int) -> dict[str, float]:
    return choice_logprobs.top_logprobs[step]


def test_logit_bias_shifts_logprobs_by_the_bias(client, token_ids):
    plain = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=10)
    top = _top(plain.choices[0].logprobs, 0)
    ranked = [s for s in sorted(top, key=top.get, reverse=True) if s in token_ids]
    target, best = ranked[3], ranked[0]
    bias = round(top[best] - top[target] + 1.0, 3)  # enough to make the 4th best the argmax
    biased = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=10,
                                       logit_bias={str(token_ids[target]): bias})  # fmt: skip
    btop = _top(biased.choices[0].logprobs, 0)
    assert biased.choices[0].text == target
    for other in ranked[:3]:
        assert btop[target] - btop[other] == pytest.approx(top[target] - top[other] + bias, abs=2e-3)
    banned = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(token_ids[best]): -100})  # fmt: skip
    assert banned.choices[0].text != best


@pytest.mark.parametrize(("presence", "frequency"), [(0.8, 0.0), (0.0, 0.6), (0.3, 0.4)])
def test_presence_and_frequency_penalties_follow_the_reference(
    client, token_ids, encode, presence, frequency
):
    """Greedy with penalties; at each step, the reference is the plain model's logprobs for the same context
    (prompt + tokens so far, sent as token ids) minus frequency * count + presence * (count > 0)."""
    pen = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=10,
                                    presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
    lp = pen.choices[0].logprobs
    if any(t not in token_ids for t in lp.tokens):
        pytest.skip("a generated token's string is ambiguous")
    gen = [token_ids[t] for t in lp.tokens]
    prompt_ids = encode(PROMPT)
    checked = 0
    for k in range(1, len(gen)):
        plain = client.completions.create(model=None, prompt=prompt_ids + gen[:k], max_tokens=1, temperature=0,
                                          logprobs=10)  # fmt: skip
        ptop, qtop = _top(plain.choices[0].logprobs, 0), _top(lp, k)
        common = [s for s in qtop if s in ptop and s in token_ids]
        base = common[0]

        def penalty(s: str, history: list[int] = gen[:k]) -> float:
            n = history.count(token_ids[s])
            return frequency * n + presence * (n > 0)

        for s in common[1:]:
            want = (ptop[s] - penalty(s)) - (ptop[base] - penalty(base))
            assert qtop[s] - qtop[base] == pytest.approx(want, abs=5e-3), (k, s)
            checked += penalty(s) != penalty(base)
    assert checked > 0  # some compared pair had different penalties: the check could fail


def test_repetition_penalty_pushes_prompt_tokens_down(client, token_ids, encode):
    """On the first step every prompt token's logit shrinks (divided when positive, multiplied when
    negative) and the others keep theirs: a prompt token loses ground against every other token."""
    prompt_ids = encode(PROMPT)
    plain = _top(client.completions.create(model=None, prompt=prompt_ids, max_tokens=1, temperature=0,
                                           logprobs=20).choices[0].logprobs, 0)  # fmt: skip
    rep = _top(client.completions.create(model=None, prompt=prompt_ids, max_tokens=1, temperature=0,
                                         logprobs=20, extra_body={"repetition_penalty": 1.5}).choices[0].logprobs, 0)  # fmt: skip
    common = [s for s in rep if s in plain and s in token_ids]
    seen = [s for s in common if token_ids[s] in prompt_ids]
    fresh = [s for s in common if token_ids[s] not in prompt_ids]
    assert seen and fresh
    for a in seen:
        for b in fresh:
            assert rep[a] - rep[b] < plain[a] - plain[b] - 1e-3
    for a in fresh:  # unpenalised pairs keep their gap
        for b in fresh:
            assert rep[a] - rep[b] == pytest.approx(plain[a] - plain[b], abs=2e-3)


def test_n_counts_against_the_clusters_queue_bound(client):
    """The chat cluster admits at most 64 waiting: n=65 could never be admitted, so it is a 400 naming n."""
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=None, prompt="Hi", max_tokens=1, n=65,
                                  extra_headers={"x-traffic-cluster": "chat"})  # fmt: skip
    assert e.value.body["param"] == "n" and "maxWaiting" in e.value.body["message"]
    ok = client.completions.create(model=None, prompt="Hi", max_tokens=1, n=64,
                                   extra_headers={"x-traffic-cluster": "chat"})  # fmt: skip
    assert len(ok.choices) == 64
