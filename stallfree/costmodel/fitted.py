"""A fitted cost model: seconds per iteration as a linear function of the iteration's features
(stallfree.costmodel.features), saved as the cost_model.json that `stallfree profile` writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stallfree.costmodel.features import FEATURES, synthetic_features


@dataclass(slots=True)
class FittedCostModel:
    """Seconds per iteration as a linear function of the iteration's features: coefficients by feature name,
    and what the fit recorded about itself (`meta`: grid, errors, host)."""

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
    def load(cls, path: str | Path) -> FittedCostModel:
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
