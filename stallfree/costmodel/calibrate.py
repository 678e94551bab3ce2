"""A cost model that keeps itself true: the engine's own iteration times refit it as it serves.

The engine predicts each iteration's time before it runs (the time-budgeted scheduler sizes chunks with
the prediction), then observes what the iteration took. `OnlineCostModel` starts from a prior (a profile
fitted by `stallfree profile`, or the conservative built-in fit when there is none) and refits its
coefficients by recursive least squares over those pairs:

- relative errors: each observation is weighted by 1 / predicted^2, so a 10 ms decode iteration counts as
  much as a 1 s prefill iteration (the SLO is a ratio, not an absolute error);
- forgetting (`forgetting`, ~1 / (1 - forgetting) iterations of memory) to follow a drift: another
  machine, a slower moment, a neighbour on the box. The covariance only inflates while its trace is under
  the prior's, so directions the traffic does not excite (no prefill for an hour) do not wind up;
- robust to a noisy box: a residual beyond `clip` times the running median absolute residual is clipped
  (Huber) before it moves the fit, so one iteration preempted by another process does not;
- monotone: the coefficients of work (tokens, attention, chunks) stay >= 0, so a longer chunk never
  predicts a shorter iteration (the scheduler bisects on that).

Predictions made before each observation are kept in a window, and `error()` reports their ratio to the
observed time: what the engine exports as its calibration health.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from stallfree.costmodel.features import DECODE_KV, FEATURES, GEMM_EXCESS, gemm_excess

# Typical magnitudes of each feature in one iteration: the fit works on features divided by these, so the
# covariance is well conditioned (prefill_attn is ~1e5 where const is 1).
_SCALES = {
    "const": 1.0,
    "prefill_tokens": 256.0,
    "decode_tokens": 16.0,
    "prefill_attn": 256.0 * 512.0,
    "decode_attn": 16.0 * 1024.0,
    DECODE_KV: 16.0 * 1024.0,
    "prefill_chunks": 1.0,
    GEMM_EXCESS: 256.0,
}

# The built-in prior: the fit of SmolLM2-135M (int4, 2 threads) on a 2-core AVX2 box
# (docs/figures/engine/avx2-box/cost_model-stack.json), its per-token terms padded up by half. Padded up is
# the safe side: a model that predicts too long makes chunks too small (slower prefill), never gaps too
# long. The engine refits it within a few hundred iterations (docs/controller.md).
BUILTIN_PRIOR = {
    "const": 0.005,
    "prefill_tokens": 0.0016245941065903696 * 1.5,
    "decode_tokens": 0.007524228455594126 * 1.5,
    "prefill_attn": 1.282763875267801e-06 * 1.5,
    "decode_attn": 8.120987194156953e-06 * 1.5,
    "prefill_chunks": 0.02112329704230518 * 1.5,
}


@dataclass(frozen=True, slots=True)
class CalibrationError:
    """How far the predictions made before each of the last `samples` iterations were from what they took:
    quantiles of |predicted / observed - 1|, and the median ratio (its sign: > 1 predicts too long)."""

    samples: int
    median: float
    p95: float
    median_ratio: float

    def to_json(self) -> dict[str, float]:
        return {
            "samples": self.samples,
            "median": self.median,
            "p95": self.p95,
            "medianRatio": self.median_ratio,
        }


class OnlineCostModel:
    """Seconds per iteration, linear in the iteration's features, refitted from observed iteration times.

    `predict(features)` has FittedCostModel's signature, so the scheduler, the simulator and the engine can
    hold either."""

    def __init__(
        self,
        prior: Mapping[str, float] | None = None,
        *,
        gemm_knee: float | None = None,
        forgetting: float = 0.98,
        prior_spread: float = 1.0,
        clip: float = 3.0,
        window: int = 512,
    ) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting}")
        if prior_spread <= 0:
            raise ValueError(f"prior_spread must be > 0, got {prior_spread}")
        coefficients = dict(BUILTIN_PRIOR if prior is None else prior)
        if GEMM_EXCESS in coefficients and gemm_knee is None:
            raise ValueError(f"a {GEMM_EXCESS} coefficient needs gemm_knee")
        unknown = set(coefficients) - set(_SCALES)
        if unknown:
            raise ValueError(f"unknown cost model features {sorted(unknown)}; known: {sorted(_SCALES)}")
        self.names = [n for n in (*FEATURES, DECODE_KV, GEMM_EXCESS) if n in coefficients]
        if "const" not in self.names:
            self.names.insert(0, "const")
            coefficients["const"] = 0.0
        self.gemm_knee = gemm_knee
        self.forgetting = forgetting
        self.clip = clip
        self._scale = np.array([_SCALES[n] for n in self.names])
        self._w = np.array([coefficients[n] for n in self.names]) * self._scale
        # Prior spread: each weight may be off by `prior_spread` times its size (at least a floor, so a
        # zero in the prior can still be learned).
        floor = max(float(np.abs(self._w).max()), 1e-6) * 0.05
        spread = prior_spread * np.maximum(np.abs(self._w), floor)
        self._P = np.diag(spread**2)
        self._trace_max = float(np.trace(self._P))
        self._abs_residual = 0.0  # running median absolute (relative) residual, for the clip
        self.observations = 0
        self._signs: deque[bool] = deque(maxlen=4)
        self._ratios: deque[float] = deque(maxlen=window)
        self.coefficients = self._coefficients()

    # ---- prediction ------------------------------------------------------------------------------------
    def _coefficients(self) -> dict[str, float]:
        return {n: float(w / s) for n, w, s in zip(self.names, self._w, self._scale, strict=True)}

    def predict(self, features: Mapping[str, float]) -> float:
        """Seconds the iteration with these features takes (stallfree.costmodel.features)."""
        t = 0.0
        for name, c in self.coefficients.items():
            if name == GEMM_EXCESS:
                x = features.get(GEMM_EXCESS)
                if x is None and self.gemm_knee is not None:
                    x = gemm_excess(dict(features), self.gemm_knee)
                t += c * (x or 0.0)
            else:
                t += c * features.get(name, 0.0)
        return t

    def _vector(self, features: Mapping[str, float]) -> np.ndarray:
        x = [features.get(n, 0.0) for n in self.names]
        if GEMM_EXCESS in self.names and features.get(GEMM_EXCESS) is None:
            x[self.names.index(GEMM_EXCESS)] = gemm_excess(dict(features), self.gemm_knee or 0.0)
        return np.array(x, dtype=float) / self._scale

    # ---- calibration -----------------------------------------------------------------------------------
    def observe(self, features: Mapping[str, float], seconds: float) -> float:
        """Take one observed iteration; returns the prediction made for it before (seconds)."""
        predicted = self.predict(features)
        if not seconds > 0 or not math.isfinite(seconds):
            return predicted
        self._ratios.append(predicted / seconds)
        self.observations += 1
        z = self._vector(features)
        # Relative errors: divide the row by a time of its size (the larger of predicted and observed, so
        # an iteration the model wrongly thinks free still counts).
        unit = max(predicted, seconds, 1e-6)
        zr, yr = z / unit, seconds / unit
        residual = yr - float(zr @ self._w)
        # Huber: clip a residual far beyond the usual one (a stall from outside the engine), unless the last
        # few all erred the same way: that is a drift to follow, not an outlier.
        self._signs.append(residual > 0)
        drifting = len(self._signs) == self._signs.maxlen and len(set(self._signs)) == 1
        if self.observations > 20 and self._abs_residual > 0 and not drifting:
            bound = self.clip * self._abs_residual / 0.6745
            residual = max(-bound, min(bound, residual))
        self._abs_residual += (abs(residual) - self._abs_residual) * (0.05 if self.observations > 1 else 1.0)
        lam = self.forgetting if float(np.trace(self._P)) < self._trace_max else 1.0
        Pz = self._P @ zr
        gain = Pz / (lam + float(zr @ Pz))
        self._w = self._w + gain * residual
        self._P = (self._P - np.outer(gain, Pz)) / lam
        self._P = (self._P + self._P.T) / 2  # keep it symmetric against round-off
        # Work never makes an iteration shorter: the work coefficients stay >= 0 (const is free: a fit may
        # put a negative intercept under steep per-token terms).
        for i, name in enumerate(self.names):
            if name != "const" and self._w[i] < 0:
                self._w[i] = 0.0
        self.coefficients = self._coefficients()
        return predicted

    def error(self, last: int | None = None) -> CalibrationError | None:
        """Quantiles of |predicted / observed - 1| over the last `last` (default: the window) iterations;
        None before any."""
        ratios = list(self._ratios)[-last:] if last else list(self._ratios)
        if not ratios:
            return None
        r = np.asarray(ratios)
        dev = np.abs(r - 1.0)
        return CalibrationError(
            len(ratios),
            float(np.median(dev)),
            float(np.percentile(dev, 95)),
            float(np.median(r)),
        )
