"""The profiler's part of the cost model: a least-squares fit of iteration times to their features.

The fit minimises relative error (weights 1/T), because iterations span two orders of magnitude and the
SLO cares about every one of them; coefficients that come out negative are dropped and the fit redone, so
predictions stay monotone in every feature.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stallfree.costmodel.features import FEATURES, GEMM_EXCESS, gemm_excess
from stallfree.costmodel.fitted import FittedCostModel


def _design(rows: Sequence[dict[str, float]], names: Sequence[str]) -> np.ndarray:
    return np.array([[r.get(k, 0.0) for k in names] for r in rows], dtype=np.float64)


def fit(
    rows: Sequence[dict[str, float]], times: Sequence[float], features: Sequence[str] = FEATURES
) -> FittedCostModel:
    """Weighted least squares (relative error) with non-negative coefficients (drop and refit)."""
    y = np.asarray(times, dtype=np.float64)
    if len(y) != len(rows) or len(y) == 0:
        raise ValueError(f"need one time per feature row, got {len(rows)} rows and {len(y)} times")
    if np.any(y <= 0):
        raise ValueError("iteration times must be > 0")
    active = [k for k in features if np.any(_design(rows, [k]))]
    w = 1.0 / y
    while True:
        x = _design(rows, active)
        scale = np.abs(x).max(axis=0)  # column scaling keeps the solve well conditioned
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq((x / scale) * w[:, None], y * w, rcond=None)
        coef = sol / scale
        neg = [k for k, c in zip(active, coef, strict=True) if c < 0 and k != "const"]
        if not neg:
            break
        # Drop the most negative (relative to its column's typical contribution) and refit.
        worst = min(neg, key=lambda k: coef[active.index(k)] * scale[active.index(k)])
        active.remove(worst)
    coefficients = dict.fromkeys(features, 0.0)
    coefficients.update(zip(active, (float(c) for c in coef), strict=True))
    return FittedCostModel(coefficients)


def relative_errors(
    model: FittedCostModel, rows: Sequence[dict[str, float]], times: Sequence[float]
) -> np.ndarray:
    y = np.asarray(times, dtype=np.float64)
    return np.abs(model.predict_many(rows) - y) / y


def fit_knee(
    rows: Sequence[dict[str, float]], times: Sequence[float], features: Sequence[str], knees: Sequence[float]
) -> FittedCostModel:
    """fit() with a gemm_tokens_over_knee term, at the knee (of `knees`) whose fit has the smallest median
    relative error: the knee is where a GPU's GEMMs turn from reading weights to computing."""
    best: tuple[float, FittedCostModel] | None = None
    for knee in knees:
        model = fit([r | {GEMM_EXCESS: gemm_excess(r, knee)} for r in rows], times, features)
        model.gemm_knee = float(knee)
        err = float(np.median(relative_errors(model, rows, times)))
        if best is None or err < best[0]:
            best = (err, model)
    if best is None:
        raise ValueError("need at least one knee to try")
    return best[1]


def fit_held_out(
    points: list[dict], test: set[int], features: Sequence[str] = FEATURES, knees: Sequence[float] = ()
) -> tuple[FittedCostModel, dict]:
    """Fit on the points whose index is not in `test` ({"features", "time_s"} each) and measure the error on
    both sides; marks every point with "held_out" and "predicted_s". With `knees` (GPU), the fit has a GEMM
    knee term, its knee chosen on the training points (fit_knee)."""
    train = [p for i, p in enumerate(points) if i not in test]
    held = [p for i, p in enumerate(points) if i in test]
    rows, times = [p["features"] for p in train], [p["time_s"] for p in train]
    model = fit_knee(rows, times, features, knees) if knees else fit(rows, times, features)
    for i, p in enumerate(points):
        p["held_out"] = i in test
        p["predicted_s"] = model.predict(p["features"])

    def errs(pts: list[dict]) -> np.ndarray:
        return relative_errors(model, [p["features"] for p in pts], [p["time_s"] for p in pts])

    return model, {
        "train": error_summary(errs(train)),
        "held_out": error_summary(errs(held) if held else np.array([])),
        "num_train": len(train),
        "num_held_out": len(held),
    }


def error_summary(errors: np.ndarray) -> dict[str, float | None]:
    if len(errors) == 0:
        return {"median": None, "p90": None, "max": None}
    return {
        "median": float(np.median(errors)),
        "p90": float(np.percentile(errors, 90)),
        "max": float(errors.max()),
    }
