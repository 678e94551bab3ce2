"""The scheduler with prefix caching: cached prefixes skip the budget, sharing while prefilling,
preemption, and a shadow KV cache that proves every chunk attends over the right tokens (no torch)."""

from __future__ import annotations

from factories import fake_step, make_request, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.engine.request import RequestStatus
from stallfree.engine.scheduler import Scheduler, SchedulerOutput

SYSTEM = list(range(1000, 1040))  # a 40-token "system prompt"


def run_to_end(s: Scheduler, max_steps: int = 1000, on_step=None) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return outs
        out = s.schedule()
        if on_step is not None:
            on_step(out)
        outs.append(out)
        fake_step(s, out)
    raise AssertionError("did not finish")


def test_cached_prefix_starts_the_request_and_only_the_rest_counts_against_the_budget():
    s = make_scheduler(token_budget=24, block_size=16, prefix_caching=True)
    first = make_request(0, max_tokens=1, prompt=SYSTEM + [1, 2, 3])
    s.add_request(first)
    run_to_end(s)
    second = make_request(0, max_tokens=1, prompt=SYSTEM + [7, 8, 9, 10, 11])
    s.add_request(second)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 32  # two full blocks of the system prompt came from the cache
    assert chunk.num_tokens == 13 and out.num_prefill_tokens == 13  # only the uncached rest
    assert chunk.block_table[:2] == tuple(s.block_manager.block_table(second.request_id)[:2])
    assert second.num_cached_tokens == 32
    assert out.prefix_cache == (("default", 45, 32),)


def test_without_caching_the_same_prompt_is_computed_again():
    s = make_scheduler(token_budget=24, block_size=16, prefix_caching=False)
    s.add_request(make_request(0, max_tokens=1, prompt=SYSTEM + [1]))
    run_to_end(s)
    s.add_request(make_request(0, max_tokens=1, prompt=SYSTEM + [2]))
    assert s.schedule().chunks[0].start == 0


def test_fully_cached_prompt_recomputes_its_last_block_to_get_logits():
    s = make_scheduler(token_budget=64, block_size=8, prefix_caching=True)
    prompt = SYSTEM  # 40 tokens = 5 full blocks
    s.add_request(make_request(0, max_tokens=1, prompt=prompt))
    run_to_end(s)
    again = make_request(0, max_tokens=2, prompt=prompt)
    s.add_request(again)
    out = s.schedule()
    assert out.chunks[0].start == 32 and out.chunks[0].num_tokens == 8 and out.chunks[0].sample


def test_identical_prompts_arriving_together_prefill_the_shared_blocks_once():
    s = make_scheduler(token_budget=16, block_size=8, prefix_caching=True)
    a = make_request(0, max_tokens=2, prompt=SYSTEM + [1, 2, 3])
    b = make_request(0, max_tokens=2, prompt=SYSTEM + [4, 5, 6])
    s.add_request(a)
    s.add_request(b)
    outs = run_to_end(s)
    prefill = sum(o.num_prefill_tokens for o in outs)
    # a computes 43 tokens; b only its own tail (3 tokens, plus the last shared block's partial part: none)
    assert prefill == 43 + 3
    assert b.num_cached_tokens == 40
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b))


def test_preempted_request_takes_its_cached_blocks_back():
    s = make_scheduler(token_budget=64, num_blocks=64, block_size=8, prefix_caching=True)
    r = make_request(0, max_tokens=4, prompt=SYSTEM + [9])
    s.add_request(r)
    s.schedule()  # the whole prompt in one chunk
    fake_step(s, s.schedule())  # first decode step also registers the prompt's blocks
    s._preempt(r, type("B", (), {"preempted": []})())
    assert r.num_computed_tokens == 0 and s.block_manager.num_free_blocks == 64
    out = s.schedule()
    # 42 tokens (41 prompt + 1 output): 5 full blocks cached, the partial block recomputed
    assert out.chunks[0].start == 40


# ---- a shadow KV cache: the proof that cached blocks hold the right tokens ------------------------------
@settings(max_examples=150, deadline=None)
@given(
    tails=st.lists(st.lists(st.integers(0, 3), max_size=20), min_size=1, max_size=8),
    shared=st.integers(0, 30),
    budget=st.integers(5, 40),
    num_blocks=st.integers(14, 40),
    max_tokens=st.integers(1, 8),
    policy=st.sampled_from(["sarathi", "vllm", "orca", "static"]),
)
def test_every_chunk_sees_exactly_its_own_tokens_in_the_cache(
    tails, shared, budget, num_blocks, max_tokens, policy
):
    """Each chunk's history slots must hold its request's tokens [0, start): whether they were computed by
    the request itself or came from the cache, after evictions, preemptions and budgets that split blocks."""
    bs = 4
    s = make_scheduler(
        policy=policy, token_budget=budget, num_blocks=num_blocks, block_size=bs, max_num_seqs=4,
        prefix_caching=True,
    )  # fmt: skip
    reqs = [
        make_request(0, max_tokens=max_tokens, prompt=list(range(100, 100 + shared)) + t + [7]) for t in tails
    ]
    for r in reqs:
        s.add_request(r)
    kv: dict[int, int] = {}  # slot -> token id whose K/V it holds

    def check(out: SchedulerOutput) -> None:
        s.block_manager.check_invariants()
        for c in out.chunks:
            r = s.get(c.request_id)
            tokens = r.token_slice(0, c.start + c.num_tokens)
            for p in range(c.start):
                slot = c.block_table[p // bs] * bs + p % bs
                assert kv.get(slot) == tokens[p], f"{c.request_id} position {p} reads a wrong or stale block"
        for c in out.chunks:
            for i, t in enumerate(c.token_ids):
                p = c.start + i
                kv[c.block_table[p // bs] * bs + p % bs] = t

    run_to_end(s, max_steps=3000, on_step=check)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.block_manager.num_free_blocks == num_blocks


def test_static_batches_identical_prompts_together_instead_of_waiting():
    s = make_scheduler(policy="static", token_budget=16, block_size=8, prefix_caching=True)
    a = make_request(0, max_tokens=3, prompt=SYSTEM + [1])
    b = make_request(0, max_tokens=3, prompt=SYSTEM + [2])
    s.add_request(a)
    s.add_request(b)
    assert {c.request_id for c in s.schedule().chunks} == {a.request_id, b.request_id}
