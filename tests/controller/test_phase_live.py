"""The phase-shift experiment on a live deployment: the generated SarathiDeployment files, scoring of the
load generator's records, the status timeline, and one short run against real `stallfree up` processes."""

from __future__ import annotations

import json

import pytest
import yaml

from stallfree.bench.metrics import ERROR, OK, OUTCOMES, REJECTED, TIMEOUT, RequestRecord
from stallfree.operator.controller import phase_live as pl
from stallfree.operator.controller.config import loop_inputs
from stallfree.operator.controller.phase_experiment import Req
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

    cfg = make_config()
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
def test_short_live_run_writes_complete_results(tmp_path):
    """One static budget and the adaptive run, two 15 s phases at low rates on tiny lengths."""
    from stallfree.bench.traces import load_trace

    try:
        load_trace("arxiv")
    except (FileNotFoundError, ValueError) as e:  # the shared traces are part of the test set-up
        pytest.fail(f"traces missing: {e}")
    out = tmp_path / "out"
    rc = pl.main(["--out", str(out), "--budgets", "256", "--initial", "256", "--phases", "0.4/0,0.2/0.2",
                  "--phase-seconds", "15", "--chat-scale", "0.05", "--summ-scale", "0.05",
                  "--interval", "2", "--window", "5", "--ready-timeout", "240"])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and set(res["static"]) == {"256"} and res["adaptive"]
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
    # --report scores the saved records again with the saved command line: the same figures, no engine.
    (out / "phase_live.png").unlink()
    assert pl.main(["--out", str(out), "--report"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["summary"] == s and again["adaptive"]["phases"] == res["adaptive"]["phases"]
    assert (out / "phase_live.png").stat().st_size > 0
