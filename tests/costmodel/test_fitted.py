"""A fitted cost model's JSON file: what `stallfree profile` writes, the others load."""

from __future__ import annotations

import pytest
from costmodel_factories import make_cost_model

from stallfree.costmodel.fitted import FittedCostModel, spec_snippet


def test_save_and_load_round_trip(tmp_path):
    m = make_cost_model()
    m.meta = {"model": "x"}
    m.save(tmp_path / "c.json")
    back = FittedCostModel.load(tmp_path / "c.json")
    assert back.coefficients == pytest.approx(m.coefficients) and back.meta["model"] == "x"
    assert back.iteration_time(128, 4, 0, 100) == pytest.approx(m.iteration_time(128, 4, 0, 100))
    with pytest.raises(ValueError, match="stallfree profile"):
        FittedCostModel.load(tmp_path / "missing.json")


def test_snippet_says_when_the_fit_has_no_constant():
    text = spec_snippet({"const": 0.0, "prefill_tokens": 2e-3, "decode_attn": 0.0})
    assert "prefillTokens: 0.002" in text and "decodeAttn" not in text
    assert "needs const > 0" in text
