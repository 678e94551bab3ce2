"""Iteration-time cost model T(n_prefill, n_decode, context) the controller plans with.

The controller never trusts a model's absolute scale: it multiplies the prediction by a calibration factor
(observed P99 TBT / predicted iteration time at the current budget), so the model only has to get the shape
right — how much longer an iteration gets per extra prefill token. A profile fitted by `stallfree profile`
(stallfree.bench) is used when given (a file, or its coefficients in spec.controller.costModel);
otherwise a conservative built-in linear model. A profile fitted on
the serving hardware is also trusted in absolute terms (`absolute`): the budget is then kept where a full
iteration meets the strictest TBT SLO among the clusters with traffic, before any stall is observed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


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


def _prefill_context(p: float, context: float, prompt_end: float | None) -> float:
    """Mean tokens a prefill token attends to: half the prompt on average over a prompt of `context`
    tokens; for the last `p` tokens of a `prompt_end`-token prompt, prompt_end - (p - 1)/2, as the profiler
    counts them (several whole prompts when the chunk is longer than one)."""
    if prompt_end is None:
        return context / 2
    end = max(prompt_end, 0.0)
    return end - (min(p, end) - 1) / 2


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
        pc = c if prompt_end is None else 2 * _prefill_context(p, c, prompt_end)
        return (
            self.base
            + self.per_prefill * p
            + self.per_decode * d
            + self.per_decode_context * d * c
            + self.per_prefill_context * p * pc
        )


@dataclass(frozen=True, slots=True)
class ProfiledCostModel:
    """A `stallfree profile` fit (stallfree.bench.costmodel.CostModel) behind this module's interface.

    Decodes attend over `context` tokens each. A prefill token attends, on average over its prompt, to half
    the prompt before it, whatever the chunking (a prompt of P tokens costs P^2/2 query-key pairs in one
    chunk or in many), so prefill attention is charged at context/2 per token. Treating a budget-sized
    chunk as one prompt starting at 0 instead would charge budget/2 per token and make budgets larger
    than the prompts look slower than they are."""

    fit: object
    absolute: bool = True  # fitted on the hardware it serves on

    def iteration_time(
        self, n_prefill: float, n_decode: float, context: float, prompt_end: float | None = None
    ) -> float:
        p, d, c = max(n_prefill, 0.0), max(n_decode, 0.0), max(context, 0.0)
        features = {
            "const": 1.0,
            "prefill_tokens": p,
            "prefill_attn": p * _prefill_context(p, c, prompt_end),
            "prefill_chunks": 1.0 if p > 0 else 0.0,
            "decode_tokens": d,
            "decode_attn": d * (c + 1) if d > 0 else 0.0,
        }
        return float(self.fit.predict(features))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Coefficients:
    """A profile's fitted coefficients by feature name: what ProfiledCostModel needs of a fit, without the
    profiler (and numpy) installed, as in the operator's image."""

    values: dict[str, float]

    def predict(self, features: dict[str, float]) -> float:
        return sum(c * features.get(k, 0.0) for k, c in self.values.items())


def from_coefficients(values: dict[str, float]) -> ProfiledCostModel:
    """A profile given by its coefficients (a SarathiDeployment's spec.controller.costModel)."""
    if not values.get("const", 0.0) > 0:
        raise ValueError("a cost model needs const (seconds per iteration) > 0")
    return ProfiledCostModel(Coefficients({k: float(v) for k, v in values.items()}))


# Built in: measured shape of SmolLM2-135M on a 2-core CPU, padded up (conservative: longer iterations
# per prefill token make the controller grow the budget in smaller steps).
BUILTIN = LinearCostModel()


def budget_for_time(
    model: CostModel,
    seconds: float,
    n_decode: float,
    context: float,
    lo: int,
    hi: int,
    prompt_end: float | None = None,
) -> int:
    """Largest budget in [lo, hi] (prefill + decode tokens) whose iteration fits in `seconds`; lo when none
    (`prompt_end`: its prefill is the last chunk of a prompt that long). Bisection, so any monotone model
    works."""
    d = max(n_decode, 0.0)

    def fits(b: int) -> bool:
        return model.iteration_time(max(b - d, 0.0), d, context, prompt_end) <= seconds

    if not fits(lo):
        return lo
    if fits(hi):
        return hi
    a, b = lo, hi  # fits(a), not fits(b)
    while b - a > 1:
        m = (a + b) // 2
        a, b = (m, b) if fits(m) else (a, m)
    return a


def prefill_capacity(model: CostModel, budget: int, n_decode: float, context: float) -> float:
    """Prefill tokens per second one replica serves when every iteration is full at `budget`."""
    d = max(n_decode, 0.0)
    p = max(budget - d, 0.0)
    t = model.iteration_time(p, d, context)
    return p / t if t > 0 else 0.0


def budget_for_demand(
    model: CostModel, demand: float, n_decode: float, context: float, lo: int, hi: int, align: int
) -> int:
    """Smallest aligned budget in [lo, hi] whose modelled prefill capacity serves `demand` tokens/s; the
    budget with the most capacity when none does (capacity need not be monotone in the budget)."""
    step = max(align, 1)
    candidates = list(range(lo, hi + 1, step)) or [lo]
    for b in candidates:
        if prefill_capacity(model, b, n_decode, context) >= demand:
            return b
    return max(candidates, key=lambda b: prefill_capacity(model, b, n_decode, context))


def load_cost_model(path: str | Path | None) -> CostModel:
    """The fitted model in a `stallfree profile` JSON file, or BUILTIN when path is None.

    Accepts the bench helper's file (through stallfree.bench when installed) and a plain
    {"coefficients": {"base": .., "per_prefill": .., ...}} document. Raises ValueError on a bad file.
    """
    if path is None:
        return BUILTIN
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cost model {path}: cannot read it: {e}") from e
    if "const" in (doc.get("coefficients") or {}):  # `stallfree profile` output (stallfree.bench.costmodel)
        from stallfree.bench.costmodel import CostModel as BenchCostModel

        return ProfiledCostModel(BenchCostModel.load(path))
    coeffs = doc.get("coefficients", doc.get("fit", doc))
    known = {f for f in LinearCostModel.__dataclass_fields__} - {"absolute"}
    picked: dict[str, Any] = {
        k: float(v) for k, v in coeffs.items() if k in known and isinstance(v, (int, float))
    }
    if not picked:
        raise ValueError(f"cost model {path}: no coefficients among {sorted(known)}")
    return LinearCostModel(**picked)
