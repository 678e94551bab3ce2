"""A profile given in the SarathiDeployment (spec.controller.costModel): what `stallfree profile` prints
parses into the spec and plans exactly as the profile file does, for the operator and local mode alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from stallfree.costmodel.fitted import FittedCostModel, spec_snippet
from stallfree.costmodel.model import BUILTIN, from_coefficients, load_cost_model
from stallfree.operator.controller.config import loop_inputs
from stallfree.operator.spec import SarathiSpec

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "docs" / "figures" / "engine" / "cost_model_grouped_decode.json"


def local_spec() -> dict:
    return yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())["spec"]


def test_printed_snippet_plans_as_the_profile_file():
    snippet = yaml.safe_load(spec_snippet(FittedCostModel.load(PROFILE).coefficients))
    spec = local_spec()
    spec.setdefault("controller", {}).update(snippet["spec"]["controller"])
    model = loop_inputs(SarathiSpec.model_validate(spec)).model
    from_file = load_cost_model(PROFILE)
    assert model.absolute and from_file.absolute
    for p, d, c, end in ((0, 32, 600, None), (256, 8, 900, 2000), (1024, 0, 0, 256), (128, 24, 3000, None)):
        assert model.iteration_time(p, d, c, prompt_end=end) == pytest.approx(
            from_file.iteration_time(p, d, c, prompt_end=end), rel=1e-5
        )  # the snippet prints 6 significant digits


def test_without_a_cost_model_the_builtin_shape_is_used():
    inputs = loop_inputs(SarathiSpec.model_validate(local_spec()))
    assert inputs.model is BUILTIN and not inputs.model.absolute


def test_a_cost_model_needs_a_positive_constant():
    with pytest.raises(ValueError, match="const"):
        from_coefficients({"const": 0.0, "prefill_tokens": 1e-3})
    spec = local_spec()
    spec.setdefault("controller", {})["costModel"] = {"prefillTokens": 1e-3}
    with pytest.raises(ValidationError, match="costModel.const"):
        SarathiSpec.model_validate(spec)
