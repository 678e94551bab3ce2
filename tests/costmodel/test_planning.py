"""Budgets a cost model predicts: within a time, and for a prefill demand."""

from __future__ import annotations

import pytest

from stallfree.costmodel.model import LinearCostModel
from stallfree.costmodel.planning import budget_for_demand, budget_for_time, prefill_capacity

# 10 ms per iteration + 1 ms per token, prefill or decode: a budget of B tokens takes 10 + B ms.
FLAT = LinearCostModel(base=0.01, per_prefill=1e-3, per_decode=1e-3, per_decode_context=0.0)


def test_budget_for_time_is_the_largest_that_fits():
    assert budget_for_time(FLAT, 0.110, n_decode=4, context=0, lo=32, hi=4096) == 100
    assert budget_for_time(FLAT, 10.0, n_decode=4, context=0, lo=32, hi=4096) == 4096  # all fit
    assert budget_for_time(FLAT, 0.001, n_decode=4, context=0, lo=32, hi=4096) == 32  # none fits: lo


def test_prefill_capacity_counts_only_prefill_tokens():
    # budget 110 with 10 decodes: 100 prefill tokens per 120 ms iteration
    assert prefill_capacity(FLAT, 110, n_decode=10, context=0) == pytest.approx(100 / 0.120)
    assert prefill_capacity(FLAT, 8, n_decode=10, context=0) == 0.0


def test_budget_for_demand_is_the_smallest_aligned_budget_serving_it():
    demand = prefill_capacity(FLAT, 256, n_decode=0, context=0)
    assert budget_for_demand(FLAT, demand, 0, 0, lo=32, hi=1024, align=32) == 256
    # more than any budget serves: the budget with the most capacity
    assert budget_for_demand(FLAT, 1e9, 0, 0, lo=32, hi=1024, align=32) == 1024
