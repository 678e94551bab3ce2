"""stallfree.slo: the one SLO type, and the one place its camelCase wire names are parsed and rendered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stallfree.slo import WIRE_NAMES, Slo


def test_defaults_are_the_crds_and_round_trip_on_the_wire():
    assert Slo() == Slo(ttft_p99=2.0, tbt_p99=0.2, scheduling_delay_p50=2.0)
    doc = {"ttftP99Seconds": 1.5, "tbtP99Seconds": 0.1, "schedulingDelayP50Seconds": 3.0}
    assert Slo.from_json(doc).to_json() == doc
    assert list(Slo().to_json()) == list(WIRE_NAMES)


def test_left_out_objectives_come_from_the_base():
    base = Slo(ttft_p99=9.0, tbt_p99=0.9, scheduling_delay_p50=4.0)
    assert Slo.from_json({"tbtP99Seconds": 0.3}, base=base) == Slo(9.0, 0.3, 4.0)
    assert Slo.from_json({}) == Slo()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tbtP99Seconds": 0}, "slo.tbtP99Seconds must be positive"),
        ({"ttftP99Seconds": -1.0}, "slo.ttftP99Seconds must be positive"),
        ({"ttftP99Seconds": True}, "slo.ttftP99Seconds must be positive"),
        ({"tbtP99Seconds": "fast"}, "slo.tbtP99Seconds must be positive"),
        ({"tbtP99": 0.2}, "unknown field"),
    ],
)
def test_bad_documents_name_the_field(doc, message):
    with pytest.raises(ValueError, match=message):
        Slo.from_json(doc)


def test_a_non_positive_objective_is_refused():
    with pytest.raises(ValueError, match="tbt_p99"):
        Slo(ttft_p99=1.0, tbt_p99=0.0)


def test_met_checks_only_the_objectives_with_a_sample():
    slo = Slo(ttft_p99=1.0, tbt_p99=0.2, scheduling_delay_p50=0.5)
    seen = SimpleNamespace
    assert slo.met(seen(ttft_p99=None, tbt_p99=None, scheduling_delay_p50=None)) is None
    assert slo.met(seen(ttft_p99=None, tbt_p99=0.1, scheduling_delay_p50=None)) is True
    assert slo.met(seen(ttft_p99=1.5, tbt_p99=0.1, scheduling_delay_p50=None)) is False
