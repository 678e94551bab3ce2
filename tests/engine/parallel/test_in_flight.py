"""The pipeline's in-flight rule on the real scheduler with simulated micro-batches (pure Python, fast).

Up to P micro-batches are in flight; the oldest completes first (a FIFO pipeline). Invariants checked after
every schedule: no request is in two in-flight micro-batches, no in-flight request is preempted or has its
blocks freed, and every request finishes with exactly its max_tokens outputs.
"""

from collections import deque

from factories import fake_step, make_request, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.engine.request import RequestStatus


def run_pipelined(sched, requests, depth: int, arrivals_per_step: int = 2, max_steps: int = 20_000):
    pending = deque(requests)
    in_flight: deque = deque()
    outs = []
    for _ in range(max_steps):
        for _ in range(arrivals_per_step):
            if pending:
                sched.add_request(pending.popleft())
        if not pending and not in_flight and not sched.has_unfinished():
            return outs
        while len(in_flight) < depth:
            out = sched.schedule()
            if out.is_empty:
                break
            ids = [c.request_id for c in out.chunks]
            busy = {c.request_id for o in in_flight for c in o.chunks}
            assert not busy & set(ids), f"scheduled {busy & set(ids)} while in flight"
            assert len(ids) == len(set(ids))
            assert not busy & set(out.preempted), "preempted a request whose micro-batch is in flight"
            for rid in busy:
                assert sched.block_manager.num_blocks_of(rid) > 0, f"{rid}'s blocks freed while in flight"
            sched.mark_in_flight(out)
            in_flight.append(out)
            outs.append(out)
        if in_flight:
            done = in_flight.popleft()
            sched.complete(done)
            fake_step(sched, done)
    raise AssertionError("requests did not finish")


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=25),
    max_tokens=st.integers(1, 12),
    budget=st.sampled_from([16, 33, 64, 256]),
    policy=st.sampled_from(["sarathi", "vllm", "orca", "static"]),
    depth=st.integers(1, 4),
    num_blocks=st.sampled_from([24, 64, 256]),
)
def test_no_request_is_in_two_micro_batches(lens, max_tokens, budget, policy, depth, num_blocks):
    sched = make_scheduler(policy=policy, token_budget=budget, num_blocks=num_blocks, max_num_seqs=8)
    reqs = [make_request(n, max_tokens=max_tokens, arrival=float(i)) for i, n in enumerate(lens)]
    run_pipelined(sched, reqs, depth)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == max_tokens
    assert not sched.in_flight
    assert sched.block_manager.num_free_blocks == num_blocks


def test_stress_many_requests_depth_four():
    sched = make_scheduler(token_budget=64, num_blocks=80, max_num_seqs=32)
    reqs = [make_request(5 + (37 * i) % 200, max_tokens=1 + i % 9, arrival=float(i)) for i in range(300)]
    outs = run_pipelined(sched, reqs, depth=4, arrivals_per_step=3)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert len(outs) > 300


def test_aborting_an_in_flight_request_clears_it():
    sched = make_scheduler(token_budget=64)
    r = make_request(10, max_tokens=3)
    sched.add_request(r)
    out = sched.schedule()
    sched.mark_in_flight(out)
    assert r.request_id in sched.in_flight and sched.schedule().is_empty
    sched.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.in_flight
    sched.complete(out)  # the micro-batch coming back later is harmless


def test_two_long_prompts_that_do_not_fit_together_both_finish_under_pipelining():
    # Found by the property test above: 24 blocks hold one 241-token prompt (16 blocks) but not two, and with
    # three micro-batches in flight each prompt used to preempt itself whenever the other was in flight, so
    # they took turns throwing their progress away. The earlier one now waits for the later one to land.
    sched = make_scheduler(policy="sarathi", token_budget=33, num_blocks=24, max_num_seqs=8)
    reqs = [make_request(n, max_tokens=2, arrival=float(i)) for i, n in enumerate([1, 241, 1, 241, 128])]
    run_pipelined(sched, reqs, depth=3)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.block_manager.num_free_blocks == 24
