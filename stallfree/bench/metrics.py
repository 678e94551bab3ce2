"""Per-request records and the numbers a run is judged by: percentiles, throughput, goodput.

Definitions (the same for the load generator and the simulator):
  TTFT              first token time - send (arrival) time
  TBT               every gap between consecutive output tokens; P50/P95/P99 pool the gaps of all requests
  scheduling delay  first time any of the request's tokens ran - arrival (server-side; where reported)
  throughput        completed requests / makespan (first arrival to last completion)
  goodput           requests that met both SLOs / makespan. A request meets them when it completed, its
                    TTFT <= the TTFT SLO and its own P99 inter-token gap <= the TBT SLO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from stallfree.slo import Slo

OK = "ok"
REJECTED = "rejected"  # 429: the server refused it (admission control); counted, never hidden
ERROR = "error"
TIMEOUT = "timeout"
OUTCOMES = (OK, REJECTED, ERROR, TIMEOUT)
QUANTILES = (50, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds relative to the start of the run."""

    index: int
    prompt_tokens: int
    max_tokens: int
    arrival: float  # when it was due to be sent
    outcome: str = ERROR
    sent: float | None = None  # when it was actually sent (open loop: ~arrival)
    first_token: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of every output token (or chunk)
    output_tokens: int = 0  # tokens received (from usage when the server reports it)
    status_code: int | None = None
    error: str | None = None
    scheduling_delay: float | None = None  # when the server (or simulator) reports it per request

    @property
    def ttft(self) -> float | None:
        if self.first_token is None or self.sent is None:
            return None
        return self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        if self.finish is None or self.sent is None:
            return None
        return self.finish - self.sent

    @property
    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def meets(self, slo: Slo) -> bool:
        if self.outcome != OK or self.ttft is None or self.ttft > slo.ttft_p99:
            return False
        gaps = self.tbts
        return not gaps or percentile(gaps, 99) <= slo.tbt_p99

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, e2e=self.e2e)
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        """The record to_json wrote (its derived ttft and e2e are recomputed, not read)."""
        return cls(**{k: v for k, v in d.items() if k not in ("ttft", "e2e")})


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy), or None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def percentiles(
    values: Sequence[float] | np.ndarray, qs: Iterable[int] = QUANTILES
) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in qs}


def summarize(
    records: Sequence[RequestRecord],
    slo: Slo,
    *,
    server_scheduling_delay: dict[str, float | None] | None = None,
) -> dict:
    """The run's summary: counts by outcome, latency percentiles, throughput and goodput.

    `server_scheduling_delay` (percentiles from the server's metrics) is used when the records themselves
    carry no scheduling delay.
    """
    done = [r for r in records if r.outcome == OK]
    counts = {o: sum(1 for r in records if r.outcome == o) for o in OUTCOMES}
    starts = [r.sent if r.sent is not None else r.arrival for r in records]
    ends = [r.finish for r in records if r.finish is not None]
    makespan = (max(ends) - min(starts)) if ends and starts else 0.0
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.tbts]
    e2es = [r.e2e for r in done if r.e2e is not None]
    delays = [r.scheduling_delay for r in records if r.scheduling_delay is not None]
    if delays:
        sched, sched_source = percentiles(delays), "per-request"
    elif server_scheduling_delay:
        sched, sched_source = dict(server_scheduling_delay), "server metrics"
    else:
        sched, sched_source = {f"p{q}": None for q in QUANTILES}, "not reported"
    good = sum(1 for r in records if r.meets(slo))
    out_tokens = sum(r.output_tokens for r in done)
    rate = (lambda n: n / makespan) if makespan > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(records),
        "outcomes": counts,
        "makespan_s": makespan,
        "ttft_s": percentiles(ttfts),
        "tbt_s": percentiles(gaps),
        "e2e_s": percentiles(e2es),
        "scheduling_delay_s": sched,
        "scheduling_delay_source": sched_source,
        "throughput_rps": rate(len(done)),
        "output_tokens_per_s": rate(out_tokens),
        "goodput_rps": rate(good),
        "good_fraction": good / len(records) if records else 0.0,
        "slo": {"ttft_s": slo.ttft_p99, "tbt_s": slo.tbt_p99, "scheduling_delay_s": slo.scheduling_delay_p50},
    }


def meets_capacity_slo(summary: dict, tbt_slo: float, delay_slo: float = 2.0) -> bool:
    """The capacity criterion: P99 TBT <= SLO and P50 scheduling delay <= delay_slo, with every request
    completed (rejections or errors at a load mean the load is not served).

    Where the server reports no scheduling delay, P50 TTFT stands in for it (an upper bound).
    """
    o = summary["outcomes"]
    if o[OK] < summary["num_requests"]:
        return False
    tbt = summary["tbt_s"]["p99"]
    delay = summary["scheduling_delay_s"]["p50"]
    if delay is None:
        delay = summary["ttft_s"]["p50"]
    if tbt is None or delay is None or math.isnan(tbt):
        return False
    return tbt <= tbt_slo and delay <= delay_slo


def slo_attainment(records: Sequence[RequestRecord], ttft_slo: float, tbt_slo: float) -> float:
    """Share of a run's requests that meet both per-request SLOs: served, TTFT <= ttft_slo and their own P99
    inter-token gap <= tbt_slo (the attainment definition of capacity, beside `meets_capacity_slo`)."""
    slo = Slo(ttft_p99=ttft_slo, tbt_p99=tbt_slo)
    return sum(1 for r in records if r.meets(slo)) / len(records) if records else 0.0


def meets_attainment(summary: dict, tbt_slo: float, target: float) -> bool:
    """The attainment criterion: at least `target` of the run's requests meet TTFT and their own P99 TBT
    (summary["attainment"][str(tbt_slo)], which the capacity command adds per TBT SLO)."""
    return summary["attainment"][str(tbt_slo)] >= target
