"""What a cost model predicts about token budgets: the largest budget whose iteration fits in a time, the
prefill tokens per second a budget serves, the smallest budget serving a demand. Any monotone CostModel
works (stallfree.costmodel.model)."""

from __future__ import annotations

from stallfree.costmodel.model import CostModel


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
