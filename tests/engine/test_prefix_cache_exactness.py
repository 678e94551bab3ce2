"""Prefix caching changes no output: greedy tokens identical and logprobs within the fp32 tolerance, with
caching on and off, for budgets that split blocks, under preemption, and for a prompt entirely cached.

The cached runs are checked to have actually hit (`num_cached_tokens`), so a cache that silently never
hits cannot pass; a mutant that serves another prompt's blocks shows the comparison is sharp."""

import pytest
from engine_helpers import make_llm, prompt_ids

from stallfree.engine import SamplingParams

ATOL = 2e-3  # fp32 on CPU, as in test_chunked_prefill: same sums, different grouping


def run(loaded, prompts, *, caching, budget=4096, num_kv_blocks=200, warm=(), max_tokens=8, **kw):
    """Generate greedily with logprobs; `warm` prompts run first (they fill the cache)."""
    llm = make_llm(
        loaded, token_budget=budget, num_kv_blocks=num_kv_blocks, enable_prefix_caching=caching, **kw
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    if warm:
        llm.generate(list(warm), params, use_tqdm=False)
    return llm.generate(list(prompts), params, use_tqdm=False), llm


def assert_same(on, off):
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids, "greedy output changed with prefix caching"
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert diff < ATOL, f"logprobs differ by {diff}"


@pytest.fixture(scope="module")
def shared_prompts(default_model):
    tok = default_model.tokenizer
    system = prompt_ids(tok, 203)  # not a multiple of the block size
    tails = [prompt_ids(tok, 60)[k : k + 5 + 7 * k] for k in range(4)]
    return system, [system + t for t in tails]


@pytest.mark.parametrize("budget", [17, 50, 4096])
def test_shared_system_prompt_same_outputs_with_and_without_caching(default_model, shared_prompts, budget):
    system, prompts = shared_prompts
    warm = [system + [42]]
    on, _ = run(default_model, prompts, caching=True, budget=budget, warm=warm)
    off, _ = run(default_model, prompts, caching=False, budget=budget, warm=warm)
    assert_same(on, off)
    assert all(o.num_cached_tokens >= 192 for o in on), [o.num_cached_tokens for o in on]
    assert all(o.num_cached_tokens == 0 for o in off)


def test_identical_prompts_together_and_a_prompt_entirely_cached(default_model, shared_prompts):
    system, prompts = shared_prompts
    full = system[:192]  # exactly 12 blocks: the last block is recomputed for its logits
    batch = [prompts[0], prompts[0], full, full + [5]]
    on, _ = run(default_model, batch, caching=True, budget=33, warm=[full])
    off, _ = run(default_model, batch, caching=False, budget=33, warm=[full])
    assert_same(on, off)
    assert on[2].num_cached_tokens == 176 and on[3].num_cached_tokens == 192


def test_preemption_with_caching_gives_the_same_outputs(default_model, shared_prompts):
    _, prompts = shared_prompts
    # 20 blocks of 16: each request fits alone (<= 17 blocks), but even sharing the 12 system-prompt
    # blocks the four cannot all grow by 40 tokens at once: preemptions, then re-admission from the cache
    kw = dict(budget=64, num_kv_blocks=20, max_tokens=40)
    on, _ = run(default_model, prompts, caching=True, **kw)
    off, _ = run(default_model, prompts, caching=False, **kw)
    assert_same(on, off)
    assert any(o.metrics.num_preemptions for o in on), "the test needs preemption to mean anything"


def test_next_turn_reuses_the_previous_answer(default_model, shared_prompts):
    """Multi-turn: the second prompt is the first prompt + its answer + a new question; the answer's
    blocks (decode tokens) come from the cache too."""
    _, prompts = shared_prompts
    llm = make_llm(default_model, token_budget=4096, num_kv_blocks=200)
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    turn2 = prompts[1] + first.token_ids + prompts[2][-9:]
    on = llm.generate([turn2], params, use_tqdm=False)
    assert on[0].num_cached_tokens == (len(prompts[1]) + 40 - 1) // 16 * 16
    off, _ = run(default_model, [turn2], caching=False, max_tokens=40)
    assert_same(on, off)


def test_a_wrong_block_would_be_caught(default_model, shared_prompts, monkeypatch):
    """Mutant: the cache serves the blocks of a different prompt; outputs must differ from uncached ones."""
    from stallfree.engine import block_manager as bm_mod

    system, prompts = shared_prompts
    other = list(reversed(system)) + [1]
    # the chain without the token ids: any prompt's k-th block matches any other's
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, ids: bm_mod.hashlib.sha256(parent).digest())
    on, _ = run(default_model, [prompts[0]], caching=True, warm=[other])
    off, _ = run(default_model, [prompts[0]], caching=False, warm=[other])
    assert on[0].num_cached_tokens > 0
    with pytest.raises(AssertionError):
        assert_same(on, off)
