"""The least-squares fit: known coefficients come back, negative ones are dropped, held-out error is real."""

from __future__ import annotations

import numpy as np
import pytest
from costmodel_factories import COST, Chunk, make_cost_model

from stallfree.bench.profile import fit_with_holdout
from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fit import fit, relative_errors


def _grid(rng, n=120):
    rows = []
    for _ in range(n):
        chunks = [Chunk(1, int(rng.integers(16, 1024)), True) for _ in range(int(rng.integers(0, 48)))]
        if rng.random() < 0.8:
            chunks.append(Chunk(int(rng.integers(16, 1024)), int(rng.integers(0, 2048)), False))
        if not chunks:
            chunks.append(Chunk(1, 10, True))
        rows.append(iteration_features(chunks))
    return rows


def test_fit_recovers_known_coefficients_exactly_from_clean_data():
    rows = _grid(np.random.default_rng(0))
    model = fit(rows, make_cost_model().predict_many(rows))
    for k, v in COST.items():
        assert model.coefficients[k] == pytest.approx(v, rel=1e-6), k


def test_fit_recovers_the_main_coefficients_from_noisy_data():
    rng = np.random.default_rng(0)
    rows = _grid(rng, 300)
    times = make_cost_model().predict_many(rows) * rng.normal(1.0, 0.01, len(rows))  # 1 % noise
    model = fit(rows, times)
    for k in ("const", "prefill_tokens", "decode_tokens", "prefill_attn"):
        assert model.coefficients[k] == pytest.approx(COST[k], rel=0.1), k
    assert np.median(relative_errors(model, rows, times)) < 0.02


def test_fit_drops_features_that_would_come_out_negative():
    rng = np.random.default_rng(1)
    rows = _grid(rng)
    truth = make_cost_model(prefill_chunks=0.0, decode_attn=0.0)
    times = truth.predict_many(rows) * rng.normal(1.0, 0.03, len(rows))
    model = fit(rows, times)
    assert all(v >= 0 for k, v in model.coefficients.items() if k != "const")
    assert model.coefficients["prefill_tokens"] == pytest.approx(COST["prefill_tokens"], rel=0.15)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="one time per"):
        fit([{"const": 1.0}], [])
    with pytest.raises(ValueError, match="> 0"):
        fit([{"const": 1.0}], [0.0])


def test_holdout_error_is_reported_on_points_the_fit_did_not_see():
    rng = np.random.default_rng(2)
    rows = _grid(rng, 40)
    times = make_cost_model().predict_many(rows)
    points = [{"features": r, "time_s": t} for r, t in zip(rows, times, strict=True)]
    model, err = fit_with_holdout(points, 0.25, seed=0)
    assert err["num_held_out"] == 10 and err["num_train"] == 30
    assert sum(p["held_out"] for p in points) == 10
    assert err["held_out"]["max"] < 1e-6
