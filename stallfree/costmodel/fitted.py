"""A fitted cost model: seconds per iteration as a linear function of the iteration's features
(stallfree.costmodel.features), saved as the cost_model.json that `stallfree profile` writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallfree.costmodel.features import FEATURES, GEMM_EXCESS, gemm_excess, synthetic_features


@dataclass(slots=True)
class FittedCostModel:
    """Seconds per iteration as a linear function of the iteration's features: coefficients by feature name,
    and what the fit recorded about itself (`meta`: grid, errors, host). With `gemm_knee` (GPU fits), the
    gemm_tokens_over_knee term is derived from an iteration's token counts (features.gemm_excess) unless the
    features carry it."""

    coefficients: dict[str, float]
    meta: dict = field(default_factory=dict)
    gemm_knee: float | None = None

    def predict(self, features: dict[str, float]) -> float:
        t = sum(c * features.get(k, 0.0) for k, c in self.coefficients.items() if k != GEMM_EXCESS)
        c = self.coefficients.get(GEMM_EXCESS, 0.0)
        if c:
            # NOTE: given when the features sum several iterations (each passes the knee on its own).
            x = features.get(GEMM_EXCESS)
            if x is None and self.gemm_knee is not None:
                x = gemm_excess(features, self.gemm_knee)
            t += c * (x or 0.0)
        return t

    def predict_many(self, rows: Sequence[dict[str, float]]) -> np.ndarray:
        return np.array([self.predict(r) for r in rows])

    def iteration_time(
        self, prefill_tokens: int, decode_tokens: int, prefill_context: int = 0, decode_context: int = 0
    ) -> float:
        return self.predict(
            synthetic_features(prefill_tokens, decode_tokens, prefill_context, decode_context)
        )

    def to_json(self) -> dict:
        doc = {"features": list(FEATURES), "coefficients": self.coefficients, **self.meta}
        if self.gemm_knee is not None:
            doc.update(features=list(self.coefficients), gemm_knee_tokens=self.gemm_knee)
        return doc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> FittedCostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as e:
            raise ValueError(f"cost model {path} not found: run `stallfree profile --out DIR` first") from e
        coef = data.get("coefficients")
        if not isinstance(coef, dict) or "const" not in coef:
            raise ValueError(f"{path} is not a cost model (no coefficients.const)")
        if GEMM_EXCESS in coef and data.get("gemm_knee_tokens") is None:
            raise ValueError(f"{path}: a {GEMM_EXCESS} coefficient needs gemm_knee_tokens")
        meta = {k: v for k, v in data.items() if k not in ("features", "coefficients", "gemm_knee_tokens")}
        knee = data.get("gemm_knee_tokens")
        return cls({k: float(v) for k, v in coef.items()}, meta, None if knee is None else float(knee))


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
