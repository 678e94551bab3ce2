"""The simulator drives the real scheduler on a simulated clock."""

from __future__ import annotations

import pytest
from bench_factories import make_sim_workload
from costmodel_factories import make_cost_model

from stallfree.bench.metrics import OK, SLO, summarize
from stallfree.bench.simulator import SimConfig, parse_policy_entry, simulate, split_policy
from stallfree.bench.traces import TraceRequest, Workload


def one_request_workload(prompt, output):
    return Workload("t", 1.0, 8192, 0, 1.0, (TraceRequest(0, prompt, output, 0.0),), 0)


def test_a_lone_request_follows_the_cost_model_exactly():
    cost = make_cost_model()
    res = simulate(one_request_workload(300, 5), cost, SimConfig(policy="sarathi", token_budget=128))
    (r,) = res.records
    assert r.outcome == OK and r.output_tokens == 5 and len(r.token_times) == 5
    # Three chunks: 128 + 128 + 44 tokens, the last one samples the first token.
    prefill = sum(cost.iteration_time(n, 0, s) for n, s in ((128, 0), (128, 128), (44, 256)))
    assert r.ttft == pytest.approx(prefill)
    assert r.scheduling_delay == 0.0
    for k, gap in enumerate(r.tbts):
        assert gap == pytest.approx(cost.iteration_time(0, 1, 0, 300 + k))
    assert res.num_iterations == 3 + 4


def test_every_request_completes_with_consistent_records(tmp_path):
    wl = make_sim_workload(tmp_path, n=80, qps=2.0)
    for policy in ("sarathi", "sarathi-nohybrid", "vllm", "orca", "static"):
        res = simulate(wl, make_cost_model(), SimConfig(policy=policy, token_budget=256))
        for rec, req in zip(res.records, wl.requests, strict=True):
            assert rec.outcome == OK, policy
            assert rec.output_tokens == req.output_tokens == len(rec.token_times)
            assert (
                rec.sent == req.arrival <= rec.arrival + rec.scheduling_delay <= rec.first_token <= rec.finish
            )
            assert all(g > 0 for g in rec.tbts)


def test_chunking_bounds_tbt_where_whole_prompts_do_not(tmp_path):
    wl = make_sim_workload(tmp_path, n=80, qps=1.5, prompt=1200)
    slo = SLO(ttft=60, tbt=1)
    p99 = {
        p: summarize(simulate(wl, make_cost_model(), SimConfig(policy=p, token_budget=128)).records, slo)[
            "tbt_s"
        ]["p99"]
        for p in ("sarathi", "vllm", "orca")
    }
    assert p99["sarathi"] < p99["orca"] <= p99["vllm"]


def test_policy_entries_may_carry_their_own_budget():
    assert parse_policy_entry("sarathi@1024", 256) == ("sarathi", 1024)
    assert parse_policy_entry(" vllm ", 256) == ("vllm", 256)
    for bad, msg in (("sarathi@big", "integer"), ("sarathi@0", ">= 1"), ("fcfs@512", "unknown policy")):
        with pytest.raises(ValueError, match=msg):
            parse_policy_entry(bad, 256)


def test_policy_names():
    assert split_policy("sarathi-nohybrid") == ("sarathi", False)
    assert split_policy("vllm") == ("vllm", True)
    with pytest.raises(ValueError, match="unknown policy"):
        split_policy("fcfs")
