"""The cost model the budget controller plans with: CostModel, T(n_prefill, n_decode, context).

The controller never trusts a model's absolute scale: it multiplies the prediction by a calibration factor
(observed P99 TBT / predicted iteration time at the current budget), so the model only has to get the shape
right — how much longer an iteration gets per extra prefill token. A profile fitted by `stallfree profile`
is used when given (a file, or its coefficients in spec.controller.costModel); otherwise a conservative
built-in linear model. A profile fitted on the serving hardware is also trusted in absolute terms
(`absolute`): the budget is then kept where a full iteration meets the strictest TBT SLO among the clusters
with traffic, before any stall is observed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stallfree.costmodel.features import planning_features, prefill_context
from stallfree.costmodel.fitted import FittedCostModel


class CostModel(Protocol):
    @property
    def absolute(self) -> bool:
        """Whether the model's seconds can be taken as they are (a profile fitted on this hardware), not
        only its shape: then the decision core also keeps a full iteration within the strictest TBT SLO
        present."""
        ...

    def iteration_time(
        self, n_prefill: float, n_decode: float, context: float, prompt_end: float | None = None
    ) -> float:
        """Seconds one iteration takes with this many prefill and decode tokens at this mean context. With
        `prompt_end`, the prefill tokens are the last chunk of a prompt that long (its slowest chunk: it
        attends over the whole prompt before it) rather than average ones."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """T = base + per_prefill*p + per_decode*d + per_decode_context*d*ctx + per_prefill_context*p*ctx."""

    base: float = 0.02
    per_prefill: float = 4e-4
    per_decode: float = 1e-3
    per_decode_context: float = 1e-7
    per_prefill_context: float = 0.0
    absolute: bool = False  # built-in or hand-written coefficients: a shape, not this machine's seconds

    def iteration_time(
        self, n_prefill: float, n_decode: float, context: float, prompt_end: float | None = None
    ) -> float:
        p, d, c = max(n_prefill, 0.0), max(n_decode, 0.0), max(context, 0.0)
        pc = c if prompt_end is None else 2 * prefill_context(p, c, prompt_end)
        return (
            self.base
            + self.per_prefill * p
            + self.per_decode * d
            + self.per_decode_context * d * c
            + self.per_prefill_context * p * pc
        )


@dataclass(frozen=True, slots=True)
class ProfiledCostModel:
    """A `stallfree profile` fit behind the controller's interface: the fit's features are built from the
    controller's aggregate view (stallfree.costmodel.features.planning_features)."""

    fit: FittedCostModel
    absolute: bool = True  # fitted on the hardware it serves on

    def iteration_time(
        self, n_prefill: float, n_decode: float, context: float, prompt_end: float | None = None
    ) -> float:
        p, d, c = max(n_prefill, 0.0), max(n_decode, 0.0), max(context, 0.0)
        return float(self.fit.predict(planning_features(p, d, c, prompt_end)))


def from_coefficients(values: dict[str, float]) -> ProfiledCostModel:
    """A profile given by its coefficients (a SarathiDeployment's spec.controller.costModel)."""
    if not values.get("const", 0.0) > 0:
        raise ValueError("a cost model needs const (seconds per iteration) > 0")
    return ProfiledCostModel(FittedCostModel({k: float(v) for k, v in values.items()}))


# Built in: measured shape of SmolLM2-135M on a 2-core CPU, padded up (conservative: longer iterations
# per prefill token make the controller grow the budget in smaller steps).
BUILTIN = LinearCostModel()


def load_cost_model(path: str | Path | None) -> CostModel:
    """The fitted model in a `stallfree profile` JSON file, or BUILTIN when path is None.

    Accepts `stallfree profile`'s cost_model.json (a FittedCostModel) and a plain
    {"coefficients": {"base": .., "per_prefill": .., ...}} document. Raises ValueError on a bad file.
    """
    if path is None:
        return BUILTIN
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cost model {path}: cannot read it: {e}") from e
    if "const" in (doc.get("coefficients") or {}):  # `stallfree profile` output
        return ProfiledCostModel(FittedCostModel.load(path))
    coeffs = doc.get("coefficients", doc.get("fit", doc))
    known = {f for f in LinearCostModel.__dataclass_fields__} - {"absolute"}
    picked: dict[str, Any] = {
        k: float(v) for k, v in coeffs.items() if k in known and isinstance(v, (int, float))
    }
    if not picked:
        raise ValueError(f"cost model {path}: no coefficients among {sorted(known)}")
    return LinearCostModel(**picked)
