"""The controller's view of the cost model: the built-in linear shape, a profile behind it, loading."""

from __future__ import annotations

import json

import pytest
from costmodel_factories import make_cost_model

from stallfree.costmodel.features import planning_features
from stallfree.costmodel.model import BUILTIN, LinearCostModel, ProfiledCostModel, load_cost_model


def test_a_profile_charges_prefill_attention_at_half_the_context():
    fit = make_cost_model()
    model = ProfiledCostModel(fit)
    # 256 prefill tokens of prompts averaging 1,000 tokens attend to 500 each; 8 decodes to 1,001 each.
    expected = fit.predict(
        {"const": 1, "prefill_tokens": 256, "prefill_attn": 256 * 500, "prefill_chunks": 1,
         "decode_tokens": 8, "decode_attn": 8 * 1001}
    )  # fmt: skip
    assert model.iteration_time(256, 8, 1000) == pytest.approx(expected)
    # the last 256 tokens of a 2,000-token prompt attend to 2000 - 255/2 each: the slowest chunk
    last = planning_features(256, 8, 1000, prompt_end=2000)
    assert last["prefill_attn"] == pytest.approx(256 * (2000 - 127.5))
    assert model.iteration_time(256, 8, 1000, prompt_end=2000) > model.iteration_time(256, 8, 1000)


def test_negative_inputs_count_as_zero():
    for model in (BUILTIN, ProfiledCostModel(make_cost_model())):
        assert model.iteration_time(-5, -1, -10) == model.iteration_time(0, 0, 0)


def test_load_reads_a_profile_or_plain_coefficients(tmp_path):
    assert load_cost_model(None) is BUILTIN
    profile = tmp_path / "cost_model.json"
    make_cost_model().save(profile)
    loaded = load_cost_model(profile)
    assert isinstance(loaded, ProfiledCostModel) and loaded.absolute
    assert loaded.fit.coefficients == make_cost_model().coefficients
    plain = tmp_path / "linear.json"
    plain.write_text(json.dumps({"coefficients": {"base": 0.05, "per_prefill": 1e-3, "note": "x"}}))
    assert load_cost_model(plain) == LinearCostModel(base=0.05, per_prefill=1e-3)


def test_load_explains_a_bad_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_cost_model(tmp_path / "missing.json")
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"coefficients": {"alpha": 1.0}}))
    with pytest.raises(ValueError, match="no coefficients among"):
        load_cost_model(junk)
