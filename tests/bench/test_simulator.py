"""The simulator drives the real scheduler on a simulated clock."""

from __future__ import annotations

import pytest
from bench_factories import make_sim_workload
from costmodel_factories import make_cost_model

from stallfree.bench.metrics import OK, summarize
from stallfree.bench.simulator import (
    TIME_CAP,
    TIME_TARGET,
    ServerEntry,
    SimConfig,
    parse_policy_entry,
    parse_server_entry,
    simulate,
    split_policy,
)
from stallfree.bench.traces import TraceRequest, Workload
from stallfree.slo import Slo


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
    slo = Slo(ttft_p99=60, tbt_p99=1)
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


def test_server_entries_may_budget_in_time():
    assert parse_server_entry("sarathi@512", 256) == ServerEntry("sarathi", 512)
    assert parse_server_entry("sarathi@time", 256) == ServerEntry("sarathi", TIME_CAP, TIME_TARGET)
    assert parse_server_entry("sarathi@time0.6", 256) == ServerEntry("sarathi", TIME_CAP, 0.6)
    for bad, msg in (
        ("vllm@time", "only sarathi"),
        ("sarathi@time2", r"\(0, 1\]"),
        ("sarathi@timex", "target"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_server_entry(bad, 256)


def test_time_budgeted_iterations_hold_the_tbt_slo_a_large_token_budget_breaks(tmp_path):
    # Long prompts arriving while others decode: a 1024-token budget stalls the decodes for a whole chunk
    # iteration; budgeted in time, the chunks shrink to what the TBT SLO leaves while anyone decodes.
    wl = make_sim_workload(tmp_path, n=60, qps=1.0, prompt=1200)
    cost, slo = make_cost_model(), Slo(ttft_p99=60, tbt_p99=0.25)
    big = summarize(simulate(wl, cost, SimConfig(token_budget=1024)).records, slo)
    timed_cfg = SimConfig(token_budget=1024, time_target=0.8, tbt_slo=0.25)
    timed = simulate(wl, cost, timed_cfg)
    assert all(r.outcome == OK for r in timed.records)
    assert big["tbt_s"]["p99"] > 0.25
    assert summarize(timed.records, slo)["tbt_s"]["p99"] <= 0.25
    # ... and with nothing decoding a prompt still gets the whole cap: a lone prompt in one iteration
    lone = simulate(one_request_workload(900, 2), cost, timed_cfg)
    assert lone.num_iterations == 2
