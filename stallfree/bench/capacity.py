"""Capacity search: the largest QPS at which a run still meets its SLOs (as in the Sarathi-Serve artifact).

Expand (double the QPS until a run fails, or halve it until one passes), then bisect between the largest
passing and smallest failing QPS until they are within `tolerance` of each other. Runs are memoised by
QPS, so several SLOs are searched from the SAME runs: each later search starts from every run so far and
only adds the points its own bracket still needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

Summary = dict
Evaluate = Callable[[float], Summary]
Passes = Callable[[Summary], bool]


@dataclass(slots=True)
class SearchResult:
    capacity_qps: float  # largest passing QPS found (0.0 when even min_qps failed)
    bracket: tuple[float, float | None]  # (largest passing, smallest failing) QPS
    evaluations: list[float]  # QPS values this search looked at, in order (cached or run)
    converged: bool  # bracket within tolerance (or pinned at min_qps / max_qps)
    note: str = ""

    def to_json(self) -> dict:
        return {
            "capacity_qps": self.capacity_qps,
            "bracket": list(self.bracket),
            "evaluations": self.evaluations,
            "converged": self.converged,
            "note": self.note,
        }


@dataclass(slots=True)
class CapacitySearch:
    """Memoised runs at given QPS values, shared by the searches for several SLOs."""

    evaluate: Evaluate
    start_qps: float = 1.0
    tolerance: float = 0.05  # stop when (hi - lo) / hi <= tolerance
    min_qps: float = 0.01
    max_qps: float = 1000.0
    max_runs: int = 12  # per search, new runs only
    runs: dict[float, Summary] = field(default_factory=dict)

    def run(self, qps: float) -> Summary:
        qps = round(qps, 6)
        if qps not in self.runs:
            logger.info("capacity search: running at %.4g QPS", qps)
            self.runs[qps] = self.evaluate(qps)
        return self.runs[qps]

    def _bracket(self, passes: Passes) -> tuple[float | None, float | None]:
        fails = [q for q, s in self.runs.items() if not passes(s)]
        hi = min(fails) if fails else None
        ok = [q for q, s in self.runs.items() if passes(s) and (hi is None or q < hi)]
        return (max(ok) if ok else None), hi

    def bracket(self, passes: Passes) -> tuple[float, float | None]:
        """(largest passing, smallest failing) QPS over every run so far: a later search's runs can
        tighten an earlier search's bracket without running anything."""
        lo, hi = self._bracket(passes)
        return (lo or 0.0), hi

    def search(self, passes: Passes) -> SearchResult:
        """Find the capacity under one criterion, reusing every run made so far."""
        seen: list[float] = []
        new_runs = 0

        def probe(q: float) -> bool:
            nonlocal new_runs
            q = round(q, 6)
            new_runs += q not in self.runs
            seen.append(q)
            return passes(self.run(q))

        if not self.runs:
            probe(self.start_qps)
        lo, hi = self._bracket(passes)
        # Expand upwards until something fails.
        while hi is None:
            q = (lo or self.start_qps) * 2
            if q > self.max_qps or new_runs >= self.max_runs:
                return SearchResult(
                    lo or 0.0, (lo or 0.0, None), seen, q > self.max_qps, "no failing QPS found"
                )
            probe(q)
            lo, hi = self._bracket(passes)
        # Expand downwards until something passes.
        while lo is None:
            q = hi / 2
            if q < self.min_qps or new_runs >= self.max_runs:
                return SearchResult(0.0, (0.0, hi), seen, q < self.min_qps, f"fails even at {hi:.4g} QPS")
            probe(q)
            lo, hi = self._bracket(passes)
        # Bisect.
        while (hi - lo) / hi > self.tolerance:
            if new_runs >= self.max_runs:
                return SearchResult(lo, (lo, hi), seen, False, "run limit reached before the tolerance")
            probe((lo + hi) / 2)
            lo, hi = self._bracket(passes)
        return SearchResult(lo, (lo, hi), seen, True)
