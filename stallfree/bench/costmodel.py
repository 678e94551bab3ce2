"""The iteration cost model T(n_prefill, n_decode, context): features, least-squares fit, JSON.

    T = a + b * prefill_tokens + c * decode_tokens + d * prefill_attn + e * decode_attn + f * prefill_chunks

  prefill_tokens   tokens of prefill chunks in the batch (the linear layers' work)
  decode_tokens    running decodes (one token each; includes sampling one token)
  prefill_attn     query-key pairs of the prefill chunks: sum over chunks of n * (start + (n + 1) / 2)
  decode_attn      key positions the decodes attend to, padding included: the torch backend pads each
                   group of decodes to its longest history (stallfree.engine.decode_groups)
  prefill_chunks   number of prefill chunks (per-chunk attention calls and metadata)

The fit minimises relative error (weights 1/T), because iterations span two orders of magnitude and the
SLO cares about every one of them; coefficients that come out negative are dropped and the fit redone, so
predictions stay monotone in every feature.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallfree.engine.decode_groups import padded_decode_area

FEATURES = ("const", "prefill_tokens", "decode_tokens", "prefill_attn", "decode_attn", "prefill_chunks")


def iteration_features(chunks: Iterable) -> dict[str, float]:
    """Features of one iteration from the scheduler's chunks (anything with num_tokens, start, is_decode)."""
    f = dict.fromkeys(FEATURES, 0.0)
    f["const"] = 1.0
    decode_lens: list[int] = []
    for c in chunks:
        n = c.num_tokens
        if c.is_decode:
            decode_lens.append(c.start + 1)
        else:
            f["prefill_tokens"] += n
            f["prefill_attn"] += n * (c.start + (n + 1) / 2)
            f["prefill_chunks"] += 1
    f["decode_tokens"] = float(len(decode_lens))
    f["decode_attn"] = float(padded_decode_area(decode_lens))
    return f


def synthetic_features(
    prefill_tokens: int, decode_tokens: int, prefill_context: int = 0, decode_context: int = 0
) -> dict[str, float]:
    """Features of a hypothetical iteration: one prefill chunk at `prefill_context`, decodes at
    `decode_context` (for tuning and planning)."""
    n = prefill_tokens
    return {
        "const": 1.0,
        "prefill_tokens": float(n),
        "decode_tokens": float(decode_tokens),
        "prefill_attn": n * (prefill_context + (n + 1) / 2) if n else 0.0,
        "decode_attn": float(decode_tokens * (decode_context + 1)) if decode_tokens else 0.0,
        "prefill_chunks": 1.0 if n else 0.0,
    }


@dataclass(slots=True)
class CostModel:
    """Seconds per iteration as a linear function of the iteration's features."""

    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)

    def predict(self, features: dict[str, float]) -> float:
        return sum(c * features.get(k, 0.0) for k, c in self.coefficients.items())

    def predict_many(self, rows: Sequence[dict[str, float]]) -> np.ndarray:
        return np.array([self.predict(r) for r in rows])

    def iteration_time(
        self, prefill_tokens: int, decode_tokens: int, prefill_context: int = 0, decode_context: int = 0
    ) -> float:
        return self.predict(
            synthetic_features(prefill_tokens, decode_tokens, prefill_context, decode_context)
        )

    def to_json(self) -> dict:
        return {"features": list(FEATURES), "coefficients": self.coefficients, **self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as e:
            raise ValueError(f"cost model {path} not found: run `stallfree profile --out DIR` first") from e
        coef = data.get("coefficients")
        if not isinstance(coef, dict) or "const" not in coef:
            raise ValueError(f"{path} is not a cost model (no coefficients.const)")
        meta = {k: v for k, v in data.items() if k not in ("features", "coefficients")}
        return cls({k: float(v) for k, v in coef.items()}, meta)


def spec_snippet(coefficients: dict[str, float]) -> str:
    """The fit as a SarathiDeployment's spec.controller.costModel (YAML), for the budget controller to plan
    with in seconds (zero coefficients are the CRD's defaults and left out)."""

    def camel(name: str) -> str:
        head, *rest = name.split("_")
        return head + "".join(w.title() for w in rest)

    lines = ["spec:", "  controller:", "    costModel:  # fitted on the hardware that serves"]
    lines += [f"      {camel(k)}: {v:.6g}" for k, v in coefficients.items() if v > 0]
    if not coefficients.get("const", 0.0) > 0:
        lines.append("      # this fit has no per-iteration constant; the controller needs const > 0")
    return "\n".join(lines)


def _design(rows: Sequence[dict[str, float]], names: Sequence[str]) -> np.ndarray:
    return np.array([[r.get(k, 0.0) for k in names] for r in rows], dtype=np.float64)


def fit(
    rows: Sequence[dict[str, float]], times: Sequence[float], features: Sequence[str] = FEATURES
) -> CostModel:
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
    return CostModel(coefficients)


def relative_errors(model: CostModel, rows: Sequence[dict[str, float]], times: Sequence[float]) -> np.ndarray:
    y = np.asarray(times, dtype=np.float64)
    return np.abs(model.predict_many(rows) - y) / y


def fit_held_out(points: list[dict], test: set[int]) -> tuple[CostModel, dict]:
    """Fit on the points whose index is not in `test` ({"features", "time_s"} each) and measure the error on
    both sides; marks every point with "held_out" and "predicted_s"."""
    train = [p for i, p in enumerate(points) if i not in test]
    held = [p for i, p in enumerate(points) if i in test]
    model = fit([p["features"] for p in train], [p["time_s"] for p in train])
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
