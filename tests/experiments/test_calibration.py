"""experiments.calibration's analysis on made-up iteration logs (the live run itself is a benchmark)."""

from __future__ import annotations

import json

import numpy as np

from experiments.calibration import analyse, read_log, settled_at, windows


def test_it_reads_predictions_from_an_iteration_log(tmp_path):
    log = tmp_path / "it.jsonl"
    lines = [
        {"t": 1.0, "step_s": 0.10, "period_s": None, "chunks": [], "predicted_s": 0.12, "limit_s": 0.4},
        {"t": 2.0, "step_s": 0.20, "period_s": 1.0, "chunks": []},  # an older log line: no prediction
        {"t": 3.0, "step_s": 0.05, "period_s": 1.0, "chunks": [], "predicted_s": 0.05, "limit_s": None},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    pred, obs, prefill = read_log(log)
    assert pred.tolist() == [0.12, 0.05] and obs.tolist() == [0.10, 0.05]
    assert prefill.tolist() == [False, False]  # no chunks in these lines


def test_settled_is_where_every_later_window_meets_the_bars():
    rng = np.random.default_rng(0)
    # 150 iterations off by 50%, then 300 within a few percent
    ratio = np.concatenate([np.full(150, 1.5), 1 + rng.normal(0, 0.03, 300)])
    r = analyse(ratio * 0.1, np.full(len(ratio), 0.1), window=50)
    assert 140 <= r["settled_after_iterations"] <= 160  # a window may hold a few (< 5%) off ones
    assert r["after"]["median"] < 0.05 and r["after"]["p95"] < 0.1
    assert r["first_window"]["median"] > 0.4


def test_a_run_that_ends_off_never_settles():
    dev = np.concatenate([np.zeros(100), np.full(60, 0.5)])
    assert settled_at(windows(dev, 50), 50) is None
