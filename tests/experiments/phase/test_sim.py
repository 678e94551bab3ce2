"""The phase-shift experiment (simulator): workload construction, recovery counting, and one short run in
which the real decision core must move the budget the right way in each phase."""

from __future__ import annotations

import json

import pytest

from experiments.phase import sim as pe
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.operator.controller.types import ClusterSpec, ControllerConfig, Slo

pytestmark = pytest.mark.usefixtures("traces_available")


@pytest.fixture
def traces_available():
    from stallfree.bench.traces import load_trace

    try:
        load_trace("arxiv")
    except (FileNotFoundError, ValueError) as e:  # they ship in data/traces/
        pytest.fail(f"traces missing: {e}")


def test_parse_phases_accepts_pairs_and_names_bad_parts():
    assert pe.parse_phases("0.3/0.02,0/0.5") == [(0.3, 0.02), (0.0, 0.5)]
    for bad in ("0.3", "a/b", "0/0", "-1/2", "0.3/0.1/4"):
        with pytest.raises(ValueError, match="phase"):
            pe.parse_phases(bad)


def test_workload_follows_each_phase_rates():
    reqs, starts = pe.build_workload(200.0, [(0.5, 0.0), (0.0, 0.25)], (0.05, 0.25), seed=1)
    assert starts == [0.0, 200.0]
    first = [r for r in reqs if r.arrival < 200]
    second = [r for r in reqs if r.arrival >= 200]
    assert {r.cluster for r in first} == {"chat"}
    assert {r.cluster for r in second} == {"summarization"}
    # Poisson counts: 100 and 50 expected; 5 sigma bounds.
    assert 50 < len(first) < 150 and 15 < len(second) < 85
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:], strict=False))
    assert all(r.output <= 16 for r in second) and all(r.output <= 64 for r in first)


def test_recovery_intervals_count_from_each_phase_change():
    specs = (ClusterSpec("chat", Slo(10, 1.0, 10)), ClusterSpec("summarization", Slo(60, 5.0, 60)))
    tl = [
        {"t": 10, "tbt_p99": {"chat": 0.5, "summarization": None}},
        {"t": 101, "tbt_p99": {"chat": None, "summarization": 1.0}},  # phase 2 starts at 100: not seen yet
        {"t": 110, "tbt_p99": {"chat": 2.0, "summarization": 1.0}},  # violated
        {"t": 120, "tbt_p99": {"chat": 1.5, "summarization": 1.0}},
        {"t": 130, "tbt_p99": {"chat": 0.9, "summarization": 1.0}},  # back within: 3 intervals after 100
        {"t": 140, "tbt_p99": {"chat": 3.0, "summarization": 1.0}},  # a later violation does not count
        {"t": 210, "tbt_p99": {"chat": None, "summarization": 4.0}},  # phase 3: never out
        {"t": 310, "tbt_p99": {"chat": 3.0, "summarization": 9.0}},  # phase 4: never back
    ]
    assert pe.recovery_intervals(tl, [0, 100, 200, 300], specs, 10.0) == [3, 0, None]
    # Each violation counted from its own start, wherever it falls: the one at 140 s lasted until 210 s.
    eps = pe.violation_episodes(tl, specs, 10.0)
    assert [(e["start"], e["intervals"]) for e in eps] == [(110.0, 2), (140.0, 7), (310.0, None)]
    assert [e["worst"] for e in eps] == [2.0, 3.0, 3.0]
    assert (
        pe.longest_episode(eps) is None and pe.longest_episode(eps[:2]) == 7 and pe.longest_episode([]) == 0
    )


def test_short_run_moves_the_budget_the_right_way_in_each_phase(tmp_path):
    """A synthetic cost model with a large fixed cost per iteration: chat + long prompts need a small budget
    for chat's TBT, the document-only phase needs a large one to keep up. The adaptive run must go down in
    the first phase and up in the second, and no static budget may beat it."""
    model = FittedCostModel(
        {
            "const": 0.05,
            "prefill_tokens": 0.0004,
            "decode_tokens": 0.002,
            "prefill_attn": 0.0,
            "decode_attn": 0.0,
            "prefill_chunks": 0.02,
        }  # fmt: skip
    )
    path = tmp_path / "cost_model.json"
    model.save(path)
    out = tmp_path / "out"
    rc = pe.main([
        "--cost-model", str(path), "--out", str(out), "--phase-seconds", "240",
        "--phases", "0.5/0.3,0/2.4", "--budgets", "128,512,2048", "--initial", "512",
        "--chat-tbt-slo", "0.25", "--summ-ttft-slo", "20", "--summ-tbt-slo", "5",
    ])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert (out / "phase_shift.png").stat().st_size > 10_000
    tl = res["adaptive"]["timeline"]
    first = [x["budget"] for x in tl if x["t"] <= 240]
    second = [x["budget"] for x in tl if 240 < x["t"] <= 480]
    assert min(first) < 512, "chat TBT violations in phase 1 must lower the budget"
    assert max(second) > min(first) and max(second) > 512, "the document phase must raise it again"
    s = res["summary"]
    assert s["adaptive_goodput"] >= s["best_static_goodput"]
    assert set(res["static"]) == {"128", "512", "2048"}
    assert s["oracle_vs_best_static"] >= 1.0
    # Every request good bounds every policy: the ceiling is at least the oracle and the adaptive run.
    assert s["ceiling_goodput"] == res["num_requests"] / 480
    assert s["ceiling_goodput"] >= max(s["oracle_goodput"], s["adaptive_goodput"])
    # In this run, recovery read from each interval's own P99 comes no later than from the longer window.
    for window, own in zip(s["recovery_intervals"], s["interval_recovery_intervals"], strict=True):
        assert window is None or (own is not None and own <= window), (window, own)
    assert res["seeds"]["recovered_within_3"]["of"] == len(s["recovery_intervals"])


def _overload_model() -> FittedCostModel:
    """A synthetic profile under which 2.4 documents/s are far beyond any budget of one replica."""
    return FittedCostModel({"const": 0.05, "prefill_tokens": 0.0004, "decode_tokens": 0.002, "prefill_attn": 0.0,
                      "decode_attn": 0.0, "prefill_chunks": 0.02})  # fmt: skip


def test_a_static_queue_bound_sheds_only_the_bounded_cluster():
    """The ablation's baseline: a static budget with a hand-set maxWaiting on summarization refuses
    summarization arrivals over the bound (as the server's 429) and never chat; without it nothing is
    refused and the queue grows."""
    specs = (
        ClusterSpec("chat", Slo(20.0, 0.8, 20.0), priority=10),
        ClusterSpec("summarization", Slo(30.0, 5.0, 30.0), priority=0),
    )
    reqs, _ = pe.build_workload(60.0, [(0.5, 2.4)], (0.05, 0.25), seed=3)
    cfg = ControllerConfig(budget_min=128, budget_max=512, align=32, interval_s=10.0)
    args = (reqs, _overload_model(), specs, cfg, 256, False, 10.0, 30.0, 600.0)
    bounded, _ = pe.run(*args, {"summarization": 2})
    free, _ = pe.run(*args)
    refused = [r for r in bounded if r.rejected]
    assert refused and {r.req.cluster for r in refused} == {"summarization"}
    assert not any(r.rejected for r in free)
    # What was refused never ran; what was admitted ran to the end.
    assert all(r.first_token is None for r in refused)
    assert all(r.done for r in bounded if not r.rejected)


def test_static_queue_bounds_ablation_is_reported_beside_the_static_budgets(tmp_path, capsys):
    path = tmp_path / "cost_model.json"
    _overload_model().save(path)
    out = tmp_path / "out"
    base = ["--cost-model", str(path), "--out", str(out), "--phase-seconds", "60", "--phases", "0.5/0.3,0/2.4",
            "--budgets", "128,512", "--initial", "512"]  # fmt: skip
    with pytest.raises(SystemExit):
        pe.main([*base, "--static-queue-bounds", "4,0"])
    assert "every bound must be >= 1" in capsys.readouterr().err
    assert pe.main([*base, "--static-queue-bounds", "2,8"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["bounded_static"]) == {"128/w2", "128/w8", "512/w2", "512/w8"}
    s = res["summary"]
    best = max(res["bounded_static"].values(), key=lambda r: r["goodput"])
    assert s["best_bounded_static_goodput"] == best["goodput"]
    assert s["adaptive_vs_best_bounded_static"] == pytest.approx(s["adaptive_goodput"] / best["goodput"])
    assert "adaptive_vs_best_bounded_static" in res["seeds"]["median"]
    assert "ablation: adaptive/best static budget with a hand-set queue bound" in capsys.readouterr().out
