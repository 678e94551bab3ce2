"""The engine's calibrated cost model on synthetic iteration times: it converges from a wrong prior, follows
a step change, shrugs off outliers and stays monotone."""

from __future__ import annotations

import numpy as np
import pytest

from stallfree.costmodel.calibrate import BUILTIN_PRIOR, OnlineCostModel
from stallfree.costmodel.features import add_chunk, decode_features

# A "true" machine: the built-in prior's shape, every term off by its own factor (the prior is wrong).
TRUE = {
    "const": 0.010,
    "prefill_tokens": BUILTIN_PRIOR["prefill_tokens"] * 0.5,
    "decode_tokens": BUILTIN_PRIOR["decode_tokens"] * 0.7,
    "prefill_attn": BUILTIN_PRIOR["prefill_attn"] * 0.4,
    "decode_attn": BUILTIN_PRIOR["decode_attn"] * 0.6,
    "prefill_chunks": BUILTIN_PRIOR["prefill_chunks"] * 0.5,
}


def true_time(f, scale: float = 1.0) -> float:
    return scale * sum(c * f.get(k, 0.0) for k, c in TRUE.items())


def iterations(rng, n: int):
    """Iterations as a server sees them: some decodes at assorted contexts, half with a prefill chunk."""
    for _ in range(n):
        d = int(rng.integers(0, 32))
        f = decode_features([int(x) for x in rng.integers(20, 1500, size=d)])
        if rng.random() < 0.5 or d == 0:
            add_chunk(f, int(rng.integers(16, 512)), int(rng.integers(0, 1500)))
        yield f


def run(model, rng, n: int, scale: float = 1.0, noise: float = 0.05, stalls: float = 0.0) -> list[float]:
    """Feed n iterations; returns |predicted / observed - 1| of each, predicted before it was observed."""
    errors = []
    for f in iterations(rng, n):
        y = true_time(f, scale) * rng.lognormal(0.0, noise)
        if rng.random() < stalls:
            y *= 5.0  # another process took the core
        errors.append(abs(model.observe(f, y) / y - 1.0))
    return errors


def test_it_converges_from_a_wrong_prior():
    rng = np.random.default_rng(0)
    model = OnlineCostModel()
    errors = run(model, rng, 400)
    assert np.median(errors[:3]) > 0.3  # the prior is far off
    assert np.median(errors[100:]) < 0.10 and np.percentile(errors[100:], 95) < 0.25
    for name, value in TRUE.items():
        if name != "const":  # the fit only has to get the times right; its terms land near the truth
            assert model.coefficients[name] == pytest.approx(value, rel=0.35), name


def test_it_follows_a_step_change_within_a_bounded_number_of_iterations():
    rng = np.random.default_rng(1)
    model = OnlineCostModel()
    run(model, rng, 400)
    errors = run(model, rng, 400, scale=1.5)  # the box got 1.5x slower
    assert np.median(errors[:10]) > 0.25
    assert np.median(errors[150:]) < 0.10  # N = 150 iterations back within 10%


def test_outliers_do_not_move_it():
    rng = np.random.default_rng(2)
    clean, noisy = OnlineCostModel(), OnlineCostModel()
    run(clean, np.random.default_rng(2), 600)
    errors = run(noisy, rng, 600, stalls=0.03)
    # judged on the iterations that were not stalled: the fit is as good as without the stalls
    assert np.median(errors[200:]) < 0.10
    for name in ("prefill_tokens", "decode_tokens"):
        assert noisy.coefficients[name] == pytest.approx(clean.coefficients[name], rel=0.25)


def test_work_coefficients_stay_non_negative_so_longer_chunks_never_predict_less():
    model = OnlineCostModel()
    rng = np.random.default_rng(3)
    for f in iterations(rng, 300):  # times that fall with prefill work would pull its terms negative
        model.observe(f, max(0.001, 0.5 - 0.001 * f["prefill_tokens"]))
    assert all(v >= 0 for k, v in model.coefficients.items() if k != "const")
    base = decode_features([100] * 4)
    times = []
    for n in (0, 16, 64, 256, 1024):
        f = dict(base)
        add_chunk(f, n, 500)
        times.append(model.predict(f))
    assert times == sorted(times)


def test_a_profile_prior_is_used_as_given_and_error_reports_the_window():
    model = OnlineCostModel(TRUE)
    f = decode_features([100] * 8)
    assert model.predict(f) == pytest.approx(true_time(f))
    assert model.error() is None
    run(model, np.random.default_rng(4), 50, noise=0.0)
    err = model.error()
    assert err.samples == 50 and err.median < 1e-6 and err.median_ratio == pytest.approx(1.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="forgetting"):
        OnlineCostModel(forgetting=0.2)
    with pytest.raises(ValueError, match="unknown cost model features"):
        OnlineCostModel({"const": 0.01, "flops": 1.0})
    with pytest.raises(ValueError, match="gemm_knee"):
        OnlineCostModel({"const": 0.01, "gemm_tokens_over_knee": 1e-5})
