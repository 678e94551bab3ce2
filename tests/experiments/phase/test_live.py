"""The phase-shift experiment on a live deployment: the generated SarathiDeployment files, scoring of the
load generator's records, the status timeline, and one short run against real `stallfree up` processes."""

from __future__ import annotations

import json

import pytest
import yaml

from experiments.phase import live as pl
from experiments.phase.sim import Req
from stallfree.bench.metrics import ERROR, OK, OUTCOMES, REJECTED, TIMEOUT, RequestRecord
from stallfree.operator.controller.config import loop_inputs
from stallfree.operator.controller.types import ClusterSpec, Slo

SPECS = (
    ClusterSpec("chat", Slo(20.0, 1.0, 20.0), priority=10),
    ClusterSpec("summarization", Slo(60.0, 5.0, 60.0), priority=0),
)


def make_config(**kw) -> pl.LiveConfig:
    return pl.LiveConfig(**{"specs": SPECS, "budgets": (128, 512, 2048), "initial": 512, "interval_s": 5,
                            "window_s": 15, **kw})  # fmt: skip


def test_static_and_adaptive_files_validate_and_differ_only_in_budget_and_controller(tmp_path):
    from stallfree.local.config import load

    cfg = make_config(adaptive_mode="tokens")
    static, adaptive = pl.deployment(cfg, 128), pl.deployment(cfg, None)
    for name, doc in (("static", static), ("adaptive", adaptive)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        dep = load(path)  # what `stallfree up FILE` does with it
        inp = loop_inputs(dep.spec)
        assert (inp.config.budget_min, inp.config.budget_max) == (128, 2048)
        assert [(s.name, s.slo, s.priority) for s in inp.specs] == [
            (s.name, s.slo, s.priority) for s in SPECS
        ]
        for c in dep.doc["spec"]["trafficClusters"]:
            assert c["match"] == {"header": c["name"]}  # the header alone decides
            assert c["chunkCap"] >= dep.spec.budget.initial  # no lower than a static run's budget
    assert static["spec"]["budget"]["initial"] == 128 and static["spec"]["controller"]["enabled"] is False
    assert adaptive["spec"]["budget"]["initial"] == 512 and adaptive["spec"]["controller"]["enabled"] is True
    assert adaptive["spec"]["controller"]["intervalSeconds"] == 5
    static["spec"]["budget"]["initial"], static["spec"]["controller"]["enabled"] = 512, True
    assert static == adaptive


def test_time_mode_adaptive_run_budgets_in_time_under_the_cap(tmp_path):
    """--adaptive time (the default): the adaptive run is what a user gets from SLOs alone with the
    controller on; its chunks may grow to the cap, so no cluster's chunkCap undercuts it. Statics unchanged."""
    from stallfree.local.config import load

    cfg = make_config(budgets=(64, 128, 256), time_target=0.7, time_cap=1024)
    static, adaptive = pl.deployment(cfg, 128), pl.deployment(cfg, None)
    assert static["spec"]["budget"] == {"initial": 128, "min": 64, "max": 256, "align": 32}
    assert adaptive["spec"]["budget"] == {
        "mode": "time",
        "timeTarget": 0.7,
        "min": 64,
        "max": 1024,
        "align": 32,
    }
    assert {c["chunkCap"] for c in adaptive["spec"]["trafficClusters"]} == {1024}
    assert {c["chunkCap"] for c in static["spec"]["trafficClusters"]} == {256}
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(adaptive))
    dep = load(path)
    assert dep.spec.budget_mode == "time" and dep.spec.time_target == 0.7
    assert (
        adaptive["spec"]["controller"]["enabled"] is True and static["spec"]["controller"]["enabled"] is False
    )


def test_budgets_off_the_alignment_are_refused_before_any_engine_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        pl.main(["--out", str(tmp_path), "--budgets", "100,512"])
    assert e.value.code == 2 and "multiples of budget.align" in capsys.readouterr().err
    assert not (tmp_path / "specs").exists()


def record(i: int, outcome: str, sent: float, first: float | None, tokens: list[float]) -> RequestRecord:
    return RequestRecord(i, 10, len(tokens), arrival=float(i), outcome=outcome, sent=sent, first_token=first,
                         token_times=tokens)  # fmt: skip


def test_report_refuses_what_is_not_a_finished_run(tmp_path):
    with pytest.raises(SystemExit, match="cannot read"):
        pl.main(["--out", str(tmp_path), "--report"])
    (tmp_path / "results.json").write_text(json.dumps({"complete": False, "adaptive": None}))
    with pytest.raises(SystemExit, match="unfinished run"):
        pl.main(["--out", str(tmp_path), "--report"])


def test_records_are_scored_like_phase_experiment():
    """Two 10 s phases; only completed requests within both SLOs count, TTFT from the actual send."""
    reqs = [Req(i, "chat" if i < 5 else "summarization", 10, 3, float(i)) for i in range(8)]
    records = [
        record(0, OK, 0.0, 1.0, [1.0, 1.5, 2.0]),  # good
        record(1, OK, 3.0, 22.0, [22.0, 22.1, 22.2]),  # sent 2 s late: TTFT 19 s, good
        record(2, OK, 2.0, 23.0, [23.0, 23.1, 23.2]),  # TTFT 21 s > 20 s
        record(3, OK, 3.0, 4.0, [4.0, 6.0, 8.0]),  # P99 TBT 2 s > 1 s
        record(4, REJECTED, 4.0, None, []),  # 429
        record(5, OK, 5.0, 30.0, [30.0, 34.0, 38.0]),  # summarization: TTFT 25 s, gaps 4 s: good
        record(6, TIMEOUT, 6.0, 7.0, [7.0]),  # cut off mid-stream
        record(7, ERROR, 7.0, None, []),
    ]
    sc = pl.judge(records, reqs, SPECS, [0.0, 5.0], 5.0, step=5.0, window=15.0)
    assert [(p["requests"], p["good"]) for p in sc["phases"]] == [(5, 2), (3, 1)]
    assert sc["goodput"] == pytest.approx(3 / 10) and sc["attainment"] == pytest.approx(3 / 8)
    assert sc["phases"][0]["attainment"] == pytest.approx(2 / 5)
    assert sc["outcomes"] == {OK: 5, REJECTED: 1, ERROR: 1, TIMEOUT: 1}
    assert sc["send_lag_s"]["max"] == pytest.approx(2.0)
    recs = pl.to_recs(records, reqs)
    assert recs[1].first_token == pytest.approx(20.0) and recs[1].tokens[-1] == pytest.approx(20.2)
    assert not recs[6].done and not recs[4].done
    # The client's windowed P99 TBT: the 2 s gaps of request 3 end at 6 and 8 s.
    assert sc["client_timeline"][1]["t"] == 10.0 and sc["client_timeline"][1]["tbt_p99"]["chat"] > 1.0


def test_the_status_timeline_keeps_one_point_per_decision():
    poller = pl.StatusPoller("http://x", ["chat", "summarization"], 1.0, 0.0)

    def doc(budget: int, when: str | None, tbt: float | None) -> dict:
        b = {"tokenBudget": budget}
        if when:
            b.update(lastDecision="lower", lastDecisionTime=when, reason="r")
        c = {"name": "chat", **({"observedTbtP99Seconds": tbt} if tbt is not None else {})}
        return {"budget": b, "trafficClusters": [c, {"name": "summarization"}]}

    poller.observe(doc(512, None, None), 0.5)  # controller off, or no decision yet
    poller.observe(doc(384, "2025-01-01T00:00:05Z", 1.4), 5.2)
    poller.observe(doc(384, "2025-01-01T00:00:05Z", 1.4), 5.7)  # the same decision again
    poller.observe(doc(256, "2025-01-01T00:00:10Z", 0.9), 10.1)
    assert [(x["t"], x["budget"]) for x in poller.timeline] == [(5.2, 384), (10.1, 256)]
    assert poller.timeline[0]["tbt_p99"] == {"chat": 1.4, "summarization": None}
    assert poller.budgets_seen == {512, 384, 256}


@pytest.mark.slow
def test_rounds_alternate_their_order_and_report_medians_of_within_round_ratios():
    from experiments.phase import rounds as phase_rounds

    names = ["static-128", "static-512", "adaptive"]
    assert phase_rounds.run_order(names, 0) == names and phase_rounds.run_order(names, 1) == names[::-1]
    assert phase_rounds.round_dirs(pl.Path("o"), 1) == [pl.Path("o")]
    assert phase_rounds.round_dirs(pl.Path("o"), 2) == [pl.Path("o/round-1"), pl.Path("o/round-2")]

    def one(g128: float, g512: float, ga: float, recovery: list) -> dict:
        static = {128: {"goodput": g128, "host": {"steal_share": 0.01}}, 512: {"goodput": g512, "host": {}}}
        best = max(g128, g512)
        summary = {"best_static_budget": 128 if g128 >= g512 else 512, "adaptive_vs_best_static": ga / best,
                   "adaptive_vs_oracle": ga / (best * 1.1), "ceiling_vs_best_static": 1.0 / best,
                   "interval_recovery_intervals": recovery, "recovery_intervals": recovery}  # fmt: skip
        return {
            "static": static,
            "adaptive": {"goodput": ga, "host": {"steal_share": 0.03}},
            "summary": summary,
        }

    # A slow box in round 2 lowers every goodput; the ratio within each round is what is compared.
    agg = phase_rounds.aggregate([one(0.4, 0.3, 0.5, [0, 2, 5]), one(0.2, 0.25, 0.3, [1, 3, 4]),
                                  one(0.4, 0.2, 0.44, [0, 0, 0])], names)  # fmt: skip
    assert [r["best_static_budget"] for r in agg["rounds"]] == [128, 512, 128]
    assert agg["median"]["adaptive_vs_best_static"] == pytest.approx(1.2)  # of 1.25, 1.2, 1.1
    assert agg["median"]["goodput"] == {"static-128": 0.4, "static-512": 0.25, "adaptive": 0.44}
    assert agg["recovered_within_3_own_p99"] == [7, 9]
    assert agg["rounds"][0]["max_steal_share"] == 0.03
    text = phase_rounds.table(agg, names)
    assert (
        "1.20x" in text and "7 of 9 within 3" in text and len(text.splitlines()) == 2 + 3 + 2
    )  # head, rule, rounds, median, note


def test_short_live_run_writes_complete_results(tmp_path):
    """One static budget and the adaptive run, two 15 s phases at low rates on tiny lengths, two rounds."""
    from stallfree.bench.traces import load_trace

    try:
        load_trace("arxiv")
    except (FileNotFoundError, ValueError) as e:  # the shared traces are part of the test set-up
        pytest.fail(f"traces missing: {e}")
    top = tmp_path / "out"
    rc = pl.main(["--out", str(top), "--budgets", "256", "--initial", "256", "--phases", "0.4/0,0.2/0.2",
                  "--phase-seconds", "15", "--chat-scale", "0.05", "--summ-scale", "0.05",
                  "--interval", "2", "--window", "5", "--ready-timeout", "240", "--rounds", "2"])  # fmt: skip
    assert rc == 0
    for k, out in enumerate([top / "round-1", top / "round-2"]):
        res = json.loads((out / "results.json").read_text())
        assert res["complete"] and set(res["static"]) == {"256"} and res["adaptive"]
        assert res["order"] == ["static-256", "adaptive"][:: 1 if k == 0 else -1]
        n = res["num_requests"]
        for name, run in [("static-256", res["static"]["256"]), ("adaptive", res["adaptive"])]:
            assert len(run["phases"]) == 2 and sum(p["requests"] for p in run["phases"]) == n
            assert sum(run["outcomes"].values()) == n
            assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
            assert 0 <= run["host"]["steal_share"] <= 1
            records = json.loads((out / f"records-{name}.json").read_text())
            assert len(records) == n and all(r["outcome"] in OUTCOMES for r in records)
            assert all(r["token_times"] for r in records if r["outcome"] == OK)
            assert (out / "specs" / f"{name}.yaml").is_file() and (out / "logs" / f"{name}.log").is_file()
        assert res["static"]["256"]["budgets_seen"] == [256]  # controller off: the budget held
        assert res["adaptive"]["timeline"] and len(res["adaptive"]["recovery_intervals"]) == 1
        s = res["summary"]
        assert s["oracle_budgets"] == [256, 256] and s["adaptive_vs_oracle"] >= 0
        assert s["ceiling_goodput"] == n / 30 and len(s["interval_recovery_intervals"]) == 1
        assert (out / "phase_live.png").stat().st_size > 0
    agg = json.loads((top / "rounds.json").read_text())
    ratios = sorted(r["adaptive_vs_best_static"] for r in agg["rounds"])
    assert len(ratios) == 2 and agg["median"]["adaptive_vs_best_static"] == pytest.approx(sum(ratios) / 2)
    assert (top / "rounds.png").stat().st_size > 0
    # --report scores the saved records again with the saved command line: the same figures, no engine.
    (top / "rounds.png").unlink()
    (out / "phase_live.png").unlink()
    assert pl.main(["--out", str(top), "--report"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["summary"] == s and again["adaptive"]["phases"] == res["adaptive"]["phases"]
    assert json.loads((top / "rounds.json").read_text()) == agg
    assert (out / "phase_live.png").stat().st_size > 0 and (top / "rounds.png").stat().st_size > 0
    assert pl.main(["--out", str(out), "--report"]) == 0  # one round on its own
