"""Capacity search logic: on a known step function, then on the simulator (fast)."""

from __future__ import annotations

import pytest
from bench_factories import make_trace
from costmodel_factories import make_cost_model

from stallfree.bench.capacity import CapacitySearch
from stallfree.bench.metrics import meets_capacity_slo
from stallfree.bench.simulate import plan_replicas, simulate_capacity
from stallfree.bench.simulator import SimConfig
from stallfree.slo import Slo


def latency_curve(qps: float) -> dict:
    """A fake run: P99 TBT grows with load (0.1 s per QPS)."""
    return {"p99": 0.1 * qps}


def test_expand_then_bisect_to_the_tolerance():
    calls = []
    s = CapacitySearch(
        lambda q: calls.append(q) or latency_curve(q), start_qps=1.0, tolerance=0.02, max_runs=30
    )
    r = s.search(lambda run: run["p99"] <= 0.37)
    assert r.converged
    assert r.capacity_qps <= 3.7 and r.capacity_qps == pytest.approx(3.7, rel=0.02)
    assert calls[:3] == [1.0, 2.0, 4.0]  # expand: double until a run fails
    lo, hi = r.bracket
    assert (hi - lo) / hi <= 0.02


def test_shrink_when_the_first_run_fails_and_report_zero_below_min():
    s = CapacitySearch(latency_curve, start_qps=8.0, tolerance=0.05, max_runs=30)
    r = s.search(lambda run: run["p99"] <= 0.25)
    assert r.capacity_qps == pytest.approx(2.5, rel=0.05) and r.evaluations[:3] == [8.0, 4.0, 2.0]
    never = CapacitySearch(latency_curve, start_qps=1.0, min_qps=0.1, max_runs=30).search(lambda run: False)
    assert never.capacity_qps == 0.0 and "fails even" in never.note


def test_several_slos_share_runs():
    calls = []
    s = CapacitySearch(
        lambda q: calls.append(q) or latency_curve(q), start_qps=1.0, tolerance=0.05, max_runs=30
    )
    relaxed = s.search(lambda run: run["p99"] <= 0.9)
    n_relaxed = len(calls)
    strict = s.search(lambda run: run["p99"] <= 0.3)
    assert relaxed.capacity_qps == pytest.approx(9, rel=0.05)
    assert strict.capacity_qps == pytest.approx(3, rel=0.05)
    fresh = []
    CapacitySearch(lambda q: fresh.append(q) or latency_curve(q), tolerance=0.05, max_runs=30).search(
        lambda run: run["p99"] <= 0.3
    )
    assert len(calls) - n_relaxed < len(fresh)  # the strict search started from the relaxed one's runs
    assert len(set(calls)) == len(calls)  # no QPS ran twice


def test_run_limit_stops_the_search_honestly():
    r = CapacitySearch(latency_curve, start_qps=1.0, tolerance=1e-6, max_runs=5).search(
        lambda run: run["p99"] <= 0.37
    )
    assert not r.converged and "limit" in r.note and r.capacity_qps < 3.7


class Args:
    num_requests, scale, max_model_len, seed = 60, 1.0, 8192, 0
    start_qps, tolerance, slo_delay = 0.5, 0.05, 2.0


def test_simulated_capacity_sarathi_beats_vllm_at_a_strict_slo(tmp_path):
    trace = make_trace(tmp_path, prompt=1200, output=30)
    cost = make_cost_model()
    slo = Slo(ttft_p99=60, tbt_p99=0.2)
    caps = {}
    for policy in ("sarathi", "vllm"):
        res = simulate_capacity(
            trace, Args, cost, SimConfig(policy=policy, token_budget=128), [0.15, 1.0], slo
        )
        caps[policy] = {t: res["by_tbt_slo"][t]["capacity_qps"] for t in ("0.15", "1.0")}
        for q, run in res["runs"].items():  # the criterion holds exactly at the reported capacity
            if float(q) == caps[policy]["0.15"]:
                assert meets_capacity_slo(run, 0.15)
    assert caps["sarathi"]["0.15"] > 2 * caps["vllm"]["0.15"]
    assert caps["sarathi"]["1.0"] >= caps["sarathi"]["0.15"]


def test_replica_plan():
    assert plan_replicas(2.0, 5.0) == 3
    assert plan_replicas(2.0, 4.0) == 2
    assert plan_replicas(0.0, 4.0) is None


def test_later_runs_tighten_an_earlier_searchs_bracket():
    s = CapacitySearch(latency_curve, start_qps=1.0, tolerance=0.3, max_runs=30)
    relaxed = s.search(lambda run: run["p99"] <= 0.9)
    s.search(lambda run: run["p99"] <= 0.3)
    s.run(8.5)  # e.g. a run another search needed
    lo, hi = s.bracket(lambda run: run["p99"] <= 0.9)
    assert lo == 8.5 >= relaxed.capacity_qps and hi <= relaxed.bracket[1]
