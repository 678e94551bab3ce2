"""Factories for cost-model tests (and the bench tests that simulate with one): a fit built visibly."""

from __future__ import annotations

from stallfree.costmodel.fitted import FittedCostModel

# A cost model shaped like the CPU's (seconds): 20 ms per iteration, 0.5 ms per prefill token, 1 ms per decode.
COST = {
    "const": 0.02,
    "prefill_tokens": 0.0005,
    "decode_tokens": 0.001,
    "prefill_attn": 1e-7,
    "decode_attn": 1e-7,
    "prefill_chunks": 0.001,
}


def make_cost_model(**overrides: float) -> FittedCostModel:
    return FittedCostModel({**COST, **overrides})


class Chunk:
    """What iteration_features reads of a scheduler chunk."""

    def __init__(self, num_tokens: int, start: int, is_decode: bool) -> None:
        self.num_tokens, self.start, self.is_decode = num_tokens, start, is_decode
