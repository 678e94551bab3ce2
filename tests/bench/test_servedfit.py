"""Fitting the cost model to a server's iteration log: the log's records, the period across idle gaps,
recovery of known coefficients, the block hold-out, and clear errors on a bad log."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stallfree.bench import profile, servedfit
from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.engine.outputs import IterationStats
from stallfree.engine.server.iteration_log import IterationLog

TRUE = {"const": 0.03, "prefill_tokens": 4e-4, "decode_tokens": 2e-3, "prefill_attn": 1e-7,
        "decode_attn": 2e-6, "prefill_chunks": 1e-3}  # fmt: skip


def stats(t: float, chunks, running: int, waiting: int = 0) -> IterationStats:
    return IterationStats(time=t, token_budget=256, num_prefill_tokens=0, num_decode_tokens=0,
                          num_prefill_requests=0, num_decode_requests=0, num_running=running,
                          num_waiting=waiting, num_preempted=0, kv_usage=0.0, time_schedule=0.001,
                          time_prepare=0.002, time_forward=0.05, time_sample=0.003, time_update=0.004,
                          chunk_shapes=tuple(chunks))  # fmt: skip


def test_iteration_log_periods_skip_idle_gaps(tmp_path):
    log = IterationLog(tmp_path / "it.jsonl")
    log.on_iteration(stats(10.0, [(64, 0, False)], running=1), {}, {}, 0.0)  # after start-up: no period
    log.on_iteration(None, {}, {}, 0.0)  # queue changes outside an iteration are not iterations
    log.on_iteration(stats(10.08, [(1, 64, True), (32, 0, False)], running=2), {}, {}, 0.0)
    log.on_iteration(stats(10.17, [(1, 65, True), (1, 32, True)], running=0), {}, {}, 0.0)  # all done: idle
    log.on_iteration(stats(25.0, [(16, 0, False)], running=1), {}, {}, 0.0)  # after idle: no period
    log.close()
    log.on_iteration(stats(26.0, [(1, 16, True)], running=1), {}, {}, 0.0)  # after close: dropped
    recs = [json.loads(x) for x in (tmp_path / "it.jsonl").read_text().splitlines()]
    assert [r["period_s"] for r in recs] == [None, pytest.approx(0.08), pytest.approx(0.09), None]
    assert recs[1]["chunks"] == [[1, 64, 1], [32, 0, 0]]
    assert recs[0]["step_s"] == pytest.approx(0.06)
    # Only iterations with a period are points for the fit.
    pts = servedfit.read_log([tmp_path / "it.jsonl"])
    assert [p["time_s"] for p in pts] == [pytest.approx(0.08), pytest.approx(0.09)]
    assert pts[0]["decodes"] == 1 and pts[0]["prefill_tokens"] == 32
    assert len(servedfit.read_log([tmp_path / "it.jsonl"], target="step")) == 4


def synthetic_log(path, n: int, seed: int, noise: float = 0.02) -> None:
    rng = np.random.default_rng(seed)
    model = FittedCostModel(TRUE)
    with path.open("w") as f:
        for i in range(n):
            chunks = [[1, int(rng.integers(50, 900)), 1] for _ in range(int(rng.integers(0, 24)))]
            if rng.random() < 0.6 or not chunks:
                chunks.append([int(rng.integers(16, 512)), int(rng.integers(0, 1500)), 0])
            f_ = iteration_features([servedfit.Shape(a, b, bool(c)) for a, b, c in chunks])
            period = model.predict(f_) * (1 + noise * rng.standard_normal())
            f.write(json.dumps({"t": i, "step_s": period * 0.8, "period_s": period, "chunks": chunks}) + "\n")


def test_profile_from_log_recovers_known_coefficients(tmp_path, capsys):
    synthetic_log(tmp_path / "a.jsonl", 600, seed=1)
    synthetic_log(tmp_path / "b.jsonl", 400, seed=2)
    out = tmp_path / "fit"
    assert (
        profile.main(["--from-log", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--out", str(out)])
        == 0
    )
    cm = FittedCostModel.load(out / "cost_model.json")
    for k in ("const", "prefill_tokens", "decode_tokens", "decode_attn"):  # the features that carry weight
        assert cm.coefficients[k] == pytest.approx(TRUE[k], rel=0.15), k
    fe = cm.meta["fit_error"]
    assert fe["num_train"] + fe["num_held_out"] == 1000 and fe["num_held_out"] >= 200
    assert fe["held_out"]["median"] < 0.03  # the noise is 2%
    p99 = fe["held_out_p99_s"]
    assert p99["predicted"] == pytest.approx(p99["measured"], rel=0.1)
    assert cm.meta["source"] == "iteration-log" and cm.meta["target"] == "period"
    assert (out / "profile.png").stat().st_size > 0 and (out / "profile.json").is_file()
    assert "held out" in capsys.readouterr().out


def test_block_holdout_takes_whole_blocks():
    held = servedfit.block_holdout(1000, 0.25, seed=0, block=50)
    assert len(held) == 250 and all(set(range(i - i % 50, i - i % 50 + 50)) <= held for i in held)
    assert servedfit.block_holdout(1000, 0.25, seed=0, block=50) == held  # seeded
    assert servedfit.block_holdout(40, 0.25, seed=0, block=50) == set()  # one block: nothing to hold out
    assert servedfit.block_holdout(1000, 0.0, seed=0) == set()


def test_bad_logs_are_refused_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1, "step_s": 0.1, "period_s": 0.1, "chunks": [[1, 2, 1]]}\n{"t": 2}\n')
    assert profile.main(["--from-log", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:2: not an iteration record" in capsys.readouterr().err
    assert profile.main(["--from-log", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "--iteration-log" in capsys.readouterr().err
    idle = tmp_path / "idle.jsonl"
    idle.write_text('{"t": 1, "step_s": 0.1, "period_s": null, "chunks": [[4, 0, 0]]}\n')
    assert profile.main(["--from-log", str(idle), "--out", str(tmp_path / "o")]) == 2
    assert "no iterations with a period_s" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
