"""The cost model: iteration features, the least-squares fit, JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest
from bench_factories import COST, make_cost_model

from stallfree.bench import costmodel
from stallfree.bench.costmodel import CostModel, fit, iteration_features, synthetic_features
from stallfree.bench.profile import fit_with_holdout


class Chunk:
    def __init__(self, num_tokens, start, is_decode):
        self.num_tokens, self.start, self.is_decode = num_tokens, start, is_decode


def test_features_of_a_hybrid_batch():
    f = iteration_features(
        [Chunk(1, 99, True), Chunk(1, 49, True), Chunk(64, 0, False), Chunk(32, 128, False)]
    )
    assert f["decode_tokens"] == 2
    assert f["decode_attn"] == 2 * 100  # padded to the longest decode context of their group
    assert f["prefill_tokens"] == 96
    assert f["prefill_chunks"] == 2
    assert f["prefill_attn"] == pytest.approx(64 * 32.5 + 32 * (128 + 16.5))
    assert f["const"] == 1


def test_decode_attn_pads_each_decode_group_to_its_own_longest():
    # a document at 4,000 tokens and two chats: the chats form their own group (engine.decode_groups)
    f = iteration_features([Chunk(1, 3999, True), Chunk(1, 99, True), Chunk(1, 79, True)])
    assert f["decode_attn"] == 4000 + 2 * 100


def test_synthetic_features_match_the_real_ones():
    s = synthetic_features(64, 3, prefill_context=128, decode_context=20)
    f = iteration_features([Chunk(1, 20, True)] * 3 + [Chunk(64, 128, False)])
    assert s == pytest.approx(f)


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
    assert np.median(costmodel.relative_errors(model, rows, times)) < 0.02


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


def test_save_and_load_round_trip(tmp_path):
    m = make_cost_model()
    m.meta = {"model": "x"}
    m.save(tmp_path / "c.json")
    back = CostModel.load(tmp_path / "c.json")
    assert back.coefficients == pytest.approx(m.coefficients) and back.meta["model"] == "x"
    assert back.iteration_time(128, 4, 0, 100) == pytest.approx(m.iteration_time(128, 4, 0, 100))
    with pytest.raises(ValueError, match="stallfree profile"):
        CostModel.load(tmp_path / "missing.json")
