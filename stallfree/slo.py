"""A traffic cluster's service-level objectives (SLOs): the one type the operator's custom resource, the
budget controller and the bench share, and the one place their wire names are parsed and rendered.

It imports nothing but the standard library, so the engine (which must not import the operator), the
operator and the bench can all use it. On the wire (the SarathiDeployment CRD, the engine's traffic-cluster
file and admin API) the objectives are camelCase seconds:

    slo: {ttftP99Seconds: 2.0, tbtP99Seconds: 0.2, schedulingDelayP50Seconds: 2.0}

The defaults are the CRD's. The engine's traffic-cluster file may leave an objective out (the engine then
has none for that cluster); it parses the same names (WIRE_NAMES) into its own optional record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

# camelCase wire name -> field name, in the order the CRD and the engine's file list them
WIRE_NAMES: dict[str, str] = {
    "ttftP99Seconds": "ttft_p99",
    "tbtP99Seconds": "tbt_p99",
    "schedulingDelayP50Seconds": "scheduling_delay_p50",
}


class Observed(Protocol):
    """What `Slo.met` compares against: a cluster's observed percentiles (None = no sample)."""

    @property
    def ttft_p99(self) -> float | None: ...
    @property
    def tbt_p99(self) -> float | None: ...
    @property
    def scheduling_delay_p50(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Slo:
    """One traffic cluster's objectives, seconds: P99 time to first token, P99 time between tokens and P50
    scheduling delay (arrival to the first time any of the request's tokens ran)."""

    ttft_p99: float = 2.0
    tbt_p99: float = 0.2
    scheduling_delay_p50: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, int | float) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"slo.{f.name} must be positive (seconds), got {v!r}")

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], base: Slo | None = None, where: str = "slo") -> Slo:
        """Parse a camelCase document; objectives it leaves out come from `base` (the CRD defaults when
        None). Raises ValueError naming the field (`slo.tbtP99Seconds`) for an unknown or bad value."""
        base = base if base is not None else cls()
        if not isinstance(doc, Mapping):
            raise ValueError(f"{where} must be a mapping, got {doc!r}")
        unknown = sorted(set(doc) - set(WIRE_NAMES))
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {unknown}; known: {list(WIRE_NAMES)}")
        kw: dict[str, float] = {}
        for key, attr in WIRE_NAMES.items():
            v = doc.get(key, getattr(base, attr))
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"{where}.{key} must be positive (seconds), got {v!r}")
            kw[attr] = float(v)
        return cls(**kw)

    def to_json(self) -> dict[str, float]:
        """The camelCase document `from_json` reads."""
        return {key: getattr(self, attr) for key, attr in WIRE_NAMES.items()}

    def met(self, c: Observed) -> bool | None:
        """Whether every objective with a sample in `c` held; None when none has a sample (no traffic)."""
        pairs = [
            (c.tbt_p99, self.tbt_p99),
            (c.ttft_p99, self.ttft_p99),
            (c.scheduling_delay_p50, self.scheduling_delay_p50),
        ]
        seen = [(o, s) for o, s in pairs if o is not None]
        return None if not seen else all(o <= s for o, s in seen)
