"""StructuredOutputsParams: exactly one constraint, checked when built; schemas keyed by their JSON text."""

import pytest

from stallfree.engine import SamplingParams
from stallfree.engine.structured import StructuredOutputsParams


def test_one_constraint_and_its_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=("a",))


def test_schema_is_stored_as_json_text_keeping_property_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b)
    assert a.json.index('"b"') < a.json.index('"a"')


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "must be an object"),
        ({"choice": ()}, "non-empty list"),
        ({"choice": ("a", "")}, "non-empty list"),
        ({"regex": "  "}, "non-empty string"),
    ],
)
def test_bad_constraints_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_carry_it():
    so = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams().structured_outputs is None
