"""Scheduler policies on fake model steps: budgets, decode-first, chunking, preemption, invariants."""

import pytest
from factories import drive, make_request, make_requests, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.engine.config import SchedulerConfig, SchedulerTunables, TrafficClusterLimits
from stallfree.engine.request import RequestStatus
from stallfree.engine.scheduler import chunk_charge, fit_chunk


def test_sarathi_chunks_a_long_prompt_under_the_budget():
    s = make_scheduler(token_budget=64)
    outs = drive(s, make_requests([200], max_tokens=2))
    prefill = [o for o in outs if o.num_prefill_tokens]
    assert [o.num_prefill_tokens for o in prefill] == [64, 64, 64, 8]
    # Positions continue across chunks: each chunk starts where the last one ended.
    assert [o.chunks[0].start for o in prefill] == [0, 64, 128, 192]
    assert [o.chunks[0].sample for o in prefill] == [False, False, False, True]


def test_sarathi_puts_decodes_first_and_fills_the_rest_with_prefill():
    s = make_scheduler(token_budget=32)
    short = make_request(4, max_tokens=50, arrival=0)
    long = make_request(300, max_tokens=2, arrival=1)
    s.add_request(short)
    o1 = s.schedule()  # short prefill only
    assert o1.num_prefill_tokens == 4
    s.get(short.request_id).output_token_ids.append(9)
    s.add_request(long)
    o2 = s.schedule()
    assert o2.chunks[0].request_id == short.request_id and o2.chunks[0].is_decode
    assert o2.num_decode_tokens == 1 and o2.num_prefill_tokens == 31
    assert o2.num_tokens == 32


def test_chunk_alignment_rounds_all_but_the_last_chunk():
    s = make_scheduler(token_budget=100, chunk_align=32)
    outs = drive(s, make_requests([150], max_tokens=1))
    assert [o.num_prefill_tokens for o in outs] == [96, 54]


def test_chunk_charge_counts_the_context_a_chunk_attends_over():
    assert chunk_charge(100, 0, None) == 100 and chunk_charge(100, 5000, None) == 100  # off: plain count
    # 100 tokens after 1000, C = 1000: mean context 1049.5, so 100 x 2.0495 -> 205 (rounded up)
    assert chunk_charge(100, 1000, 1000) == 205
    assert chunk_charge(1, 0, 1000) == 1 and chunk_charge(0, 500, 1000) == 0
    for start in (0, 1, 17, 640, 4095):
        for left in (1, 2, 31, 64, 512):
            n = fit_chunk(left, start, 256)
            # the largest chunk whose charge fits what is left
            assert chunk_charge(n, start, 256) <= left < chunk_charge(n + 1, start, 256)


def test_context_scale_shortens_chunks_deep_in_a_prompt():
    plain = drive(make_scheduler(token_budget=64), make_requests([600], max_tokens=1))
    charged = drive(
        make_scheduler(token_budget=64, chunk_context_scale=128), make_requests([600], max_tokens=1)
    )
    assert [o.num_prefill_tokens for o in plain] == [64] * 9 + [24]
    sizes = [o.num_prefill_tokens for o in charged]
    starts = [o.chunks[0].start for o in charged]
    assert sum(sizes) == 600 and sizes[0] < 64
    assert all(a >= b for a, b in zip(sizes[:-2], sizes[1:-1], strict=True))  # shorter as the context grows
    assert sizes[-2] < sizes[0] // 3  # at ~550 tokens of context a token costs ~5x
    # every iteration's charge stays within the budget, and each chunk is the largest that fits it
    for s, n in zip(starts[:-1], sizes[:-1], strict=True):
        assert chunk_charge(n, s, 128) <= 64 < chunk_charge(n + 1, s, 128)


def test_context_scale_charges_a_prompt_after_a_cache_hit_from_its_cached_prefix():
    s = make_scheduler(token_budget=64, chunk_context_scale=128, prefix_caching=True)
    first, second = make_requests([200, 400], max_tokens=1)  # the factory's prompts share their prefix
    drive(s, [first])
    s.add_request(second)
    c = s.schedule().chunks[0]
    assert c.start >= 128  # served from the cache up to here
    assert c.num_tokens == fit_chunk(64, c.start, 128) < 64


def test_decodes_cost_one_token_each_with_a_context_scale():
    s = make_scheduler(token_budget=40, chunk_context_scale=64)
    short = make_request(4, max_tokens=50, arrival=0)
    s.add_request(short)
    s.schedule()
    s.get(short.request_id).output_token_ids.append(9)
    s.add_request(make_request(300, max_tokens=2, arrival=1))
    out = s.schedule()
    assert out.num_decode_tokens == 1
    assert out.num_prefill_tokens == fit_chunk(39, 0, 64)


def test_cluster_chunk_cap_limits_prefill_tokens_per_iteration():
    caps = (TrafficClusterLimits("docs", chunk_cap=16),)
    s = make_scheduler(token_budget=64, clusters=caps)
    outs = drive(
        s, [make_request(40, max_tokens=1, cluster="docs"), make_request(40, max_tokens=1, arrival=1)]
    )
    first = outs[0]
    by_cluster = {c.traffic_cluster: c.num_tokens for c in first.chunks}
    assert by_cluster == {"docs": 16, "default": 40}


def test_cluster_max_running_holds_back_admission():
    lim = (TrafficClusterLimits("chat", max_running=1),)
    s = make_scheduler(token_budget=256, clusters=lim)
    for r in make_requests([8, 8, 8], cluster="chat"):
        s.add_request(r)
    s.schedule()
    assert s.num_running == 1 and s.num_waiting == 2


def test_lowered_max_running_pauses_requests_not_yet_streaming_at_once():
    s = make_scheduler(token_budget=64)
    streaming = [make_request(8, max_tokens=50, arrival=i, cluster="docs") for i in range(2)]
    for r in streaming:
        s.add_request(r)
    s.schedule()  # both prefill whole
    for r in streaming:
        r.output_token_ids.append(7)
    prompt = make_request(500, max_tokens=5, arrival=2, cluster="docs")
    s.add_request(prompt)
    out = s.schedule()  # two decodes, then 62 tokens of the long prompt
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 62
    for r in streaming:
        r.output_token_ids.append(7)
    later = make_request(8, max_tokens=5, arrival=3, cluster="docs")
    s.add_request(later)

    # The limit drops to 2: both streams go on (pausing them would stall them) and take the two slots; the
    # prompt still prefilling sits out, keeping its KV blocks, and nothing new is admitted.
    s.tunables = SchedulerTunables(token_budget=64, clusters=(TrafficClusterLimits("docs", max_running=2),))
    for _ in range(2):
        out = s.schedule()
        assert [c.request_id for c in out.chunks] == [r.request_id for r in streaming]
        assert out.preempted == () and s.num_running == 3 and s.num_waiting == 1
        assert prompt.num_computed_tokens == 62 and s.block_manager.num_blocks_of(prompt.request_id) > 0
        for r in streaming:
            r.output_token_ids.append(7)

    # A stream ends: the paused prompt takes the freed slot and continues where it stopped.
    s.finish_request(streaming[0].request_id, RequestStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert [(c.request_id, c.is_decode) for c in out.chunks] == [
        (streaming[1].request_id, True),
        (prompt.request_id, False),
    ]
    assert out.chunks[1].start == 62 and s.num_waiting == 1, "the limit still holds"


def test_budget_change_applies_from_the_next_iteration():
    s = make_scheduler(token_budget=64)
    s.add_request(make_request(500, max_tokens=1))
    assert s.schedule().num_tokens == 64
    s.tunables = SchedulerTunables(token_budget=128)
    assert s.schedule().num_tokens == 128


def test_vllm_runs_whole_prompts_in_prefill_only_batches():
    s = make_scheduler(policy="vllm", token_budget=64)
    outs = drive(s, make_requests([100, 30, 300], max_tokens=3))
    for o in outs:
        assert not (o.num_prefill_tokens and o.num_decode_tokens), "vllm mixed prefill and decode"
        for c in o.chunks:
            if not c.is_decode:
                assert c.start == 0 and c.sample, "vllm split a prompt"


def test_orca_mixes_decodes_with_whole_prompts():
    s = make_scheduler(policy="orca")
    s.add_request(make_request(10, max_tokens=5))
    s.schedule()
    fake = s.running[0]
    fake.output_token_ids.append(3)
    s.add_request(make_request(500, max_tokens=2))
    o = s.schedule()
    assert o.num_decode_tokens == 1 and o.num_prefill_tokens == 500


def test_static_admits_nothing_until_the_batch_drains():
    s = make_scheduler(policy="static", max_num_seqs=2)
    outs = drive(s, make_requests([5, 5, 5], max_tokens=3))
    admitted = [sorted(c.request_id for c in o.chunks if c.start == 0 and not c.is_decode) for o in outs]
    admissions = [a for a in admitted if a]
    assert len(admissions) == 2 and len(admissions[0]) == 2 and len(admissions[1]) == 1
    # The second admission happens only after both of the first batch finished (3 tokens each).
    second = next(i for i, a in enumerate(admitted) if a == admissions[1])
    assert second >= 3


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(token_budget=64, num_blocks=6, block_size=4, max_num_seqs=4)
    reqs = make_requests([8, 8], max_tokens=12)
    outs = drive(s, reqs)
    assert any(o.preempted for o in outs)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert any(r.num_preemptions for r in reqs)
    assert s.block_manager.num_free_blocks == 6


def test_priority_decides_admission_order():
    s = make_scheduler(token_budget=8)
    low = make_request(8, priority=0, arrival=0)
    high = make_request(8, priority=5, arrival=1)
    s.add_request(low)
    s.add_request(high)
    assert s.schedule().chunks[0].request_id == high.request_id


POLICIES = ["sarathi", "vllm", "orca", "static"]


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    prompt_lens=st.lists(st.integers(1, 120), min_size=1, max_size=10),
    max_tokens=st.integers(1, 12),
    budget=st.integers(8, 96),
    num_blocks=st.integers(12, 64),
    align=st.sampled_from([0, 8]),
    hybrid=st.booleans(),
    caching=st.booleans(),
    scale=st.sampled_from([None, 40]),
)
def test_scheduler_invariants(
    policy, prompt_lens, max_tokens, budget, num_blocks, align, hybrid, caching, scale
):
    block_size = 8
    max_num_seqs = 6
    budget = max(budget, max_num_seqs)  # room for every running decode
    # Every request must be able to run alone, or nothing can finish.
    num_blocks = max(num_blocks, (max(prompt_lens) + max_tokens) // block_size + 2)
    s = make_scheduler(
        policy=policy,
        token_budget=budget,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        chunk_align=align,
        hybrid_batching=hybrid,
        prefix_caching=caching,  # the factory's prompts all share their prefix: many hits
        chunk_context_scale=scale,
    )
    reqs = make_requests(prompt_lens, max_tokens=max_tokens)

    def check(sched, out, before):
        sched.block_manager.check_invariants()
        assert len(sched.running) <= max_num_seqs
        if policy == "sarathi":
            assert out.num_tokens <= budget
            # prefill chunks charged for their context (scale None: the plain count) stay within it too
            charges = [1 if c.is_decode else chunk_charge(c.num_tokens, c.start, scale) for c in out.chunks]
            assert sum(charges) <= budget
            if hybrid:
                # Every decode that was running and was not preempted got its one token.
                scheduled = {c.request_id for c in out.chunks}
                for rid, (_status, in_decode) in before.items():
                    r = sched.get(rid)
                    if in_decode and r is not None and r.status is RequestStatus.RUNNING:
                        assert rid in scheduled, "a running decode was skipped"
        for c in out.chunks:
            r = sched.get(c.request_id)
            assert c.num_tokens >= 1
            assert c.start + c.num_tokens <= r.num_tokens
            assert len(c.block_table) * block_size >= c.start + c.num_tokens

    drive(s, reqs, max_steps=5000, on_step=check)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == max_tokens for r in reqs)
    assert s.block_manager.num_free_blocks == num_blocks


def test_tunables_validate():
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerTunables(token_budget=0)
    with pytest.raises(ValueError, match="unique"):
        SchedulerTunables(clusters=(TrafficClusterLimits("a"), TrafficClusterLimits("a")))
    with pytest.raises(ValueError, match="chunk_context_scale"):
        SchedulerConfig(chunk_context_scale=0)
