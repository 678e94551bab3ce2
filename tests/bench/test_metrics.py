"""Percentiles, goodput, the capacity criterion and the Prometheus histogram arithmetic."""

from __future__ import annotations

import pytest

from stallfree.bench.loadgen import histogram_quantile, metrics_delta, parse_prometheus
from stallfree.bench.metrics import (
    ERROR,
    OK,
    REJECTED,
    RequestRecord,
    meets_attainment,
    meets_capacity_slo,
    percentile,
    slo_attainment,
    summarize,
)
from stallfree.slo import Slo


def rec(i, sent, first, gaps, outcome=OK, delay=None):
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(
        index=i, prompt_tokens=10, max_tokens=len(times), arrival=sent, outcome=outcome, sent=sent,
        first_token=first, finish=times[-1], token_times=times, output_tokens=len(times), scheduling_delay=delay,
    )  # fmt: skip


def test_percentile_interpolates_like_numpy_and_handles_empty():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([], 50) is None


def test_record_latencies():
    r = rec(0, sent=1.0, first=1.5, gaps=[0.1, 0.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.tbts == pytest.approx([0.1, 0.3])
    assert r.e2e == pytest.approx(0.9)


def test_goodput_counts_requests_meeting_both_slos():
    slo = Slo(ttft_p99=1.0, tbt_p99=0.2)
    records = [
        rec(0, 0.0, 0.5, [0.1, 0.1]),  # good
        rec(1, 0.0, 2.0, [0.1]),  # TTFT too slow
        rec(2, 1.0, 1.2, [0.1, 0.5]),  # one slow gap: its own P99 > SLO
        rec(3, 2.0, 2.5, [0.1] * 3),  # good; finishes at 2.8
        RequestRecord(4, 10, 5, 3.0, outcome=REJECTED, sent=3.0, status_code=429, finish=3.01),
    ]
    s = summarize(records, slo)
    assert s["outcomes"] == {"ok": 4, "rejected": 1, "error": 0, "timeout": 0}
    assert s["makespan_s"] == pytest.approx(3.01)
    assert s["goodput_rps"] == pytest.approx(2 / 3.01)
    assert s["throughput_rps"] == pytest.approx(4 / 3.01)
    assert s["good_fraction"] == pytest.approx(2 / 5)
    assert s["tbt_s"]["p50"] == pytest.approx(0.1)  # pooled over the 8 gaps of completed requests
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["scheduling_delay_source"] == "not reported"


def test_scheduling_delay_prefers_records_then_server():
    slo = Slo(ttft_p99=1.0, tbt_p99=0.2)
    s = summarize([rec(0, 0, 0.5, [], delay=0.3), rec(1, 0, 0.5, [], delay=0.1)], slo)
    assert (
        s["scheduling_delay_s"]["p50"] == pytest.approx(0.2) and s["scheduling_delay_source"] == "per-request"
    )
    s = summarize([rec(0, 0, 0.5, [])], slo, server_scheduling_delay={"p50": 0.7, "p95": 1, "p99": 2})
    assert s["scheduling_delay_s"]["p50"] == 0.7 and s["scheduling_delay_source"] == "server metrics"


def test_capacity_criterion():
    slo = Slo(ttft_p99=10, tbt_p99=1)
    fast = summarize([rec(i, 0, 0.5, [0.1] * 5, delay=0.2) for i in range(5)], slo)
    assert meets_capacity_slo(fast, 0.2) and not meets_capacity_slo(fast, 0.05)
    assert not meets_capacity_slo(fast, 0.2, delay_slo=0.1)
    failed = summarize([rec(0, 0, 0.5, [0.1], delay=0.2), rec(1, 0, 0.5, [0.1], outcome=ERROR)], slo)
    assert not meets_capacity_slo(failed, 10.0)  # not every request was served
    no_delay = summarize([rec(0, 0, 3.0, [0.1])], slo)  # TTFT stands in for a missing scheduling delay
    assert not meets_capacity_slo(no_delay, 1.0, delay_slo=2.0)


def test_slo_validation():
    with pytest.raises(ValueError, match="tbt"):
        Slo(ttft_p99=1.0, tbt_p99=0.0)


PROM = """# HELP stallfree_scheduling_delay_seconds x
# TYPE stallfree_scheduling_delay_seconds histogram
stallfree_scheduling_delay_seconds_bucket{le="0.1",traffic_cluster="a"} %d
stallfree_scheduling_delay_seconds_bucket{le="1.0",traffic_cluster="a"} %d
stallfree_scheduling_delay_seconds_bucket{le="+Inf",traffic_cluster="a"} %d
stallfree_scheduling_delay_seconds_count{traffic_cluster="a"} %d
stallfree_scheduling_delay_seconds_sum{traffic_cluster="a"} 1.0
stallfree_scheduling_delay_seconds_bucket{le="0.1",traffic_cluster="b"} 1
stallfree_scheduling_delay_seconds_bucket{le="1.0",traffic_cluster="b"} 1
stallfree_scheduling_delay_seconds_bucket{le="+Inf",traffic_cluster="b"} 1
stallfree_scheduling_delay_seconds_count{traffic_cluster="b"} 1
stallfree_scheduling_delay_seconds_sum{traffic_cluster="b"} 0.05
# HELP stallfree_preemptions_total preempted
# TYPE stallfree_preemptions_total counter
stallfree_preemptions_total %d
"""


def test_histogram_quantile_interpolates_within_buckets():
    b = {0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert histogram_quantile(0.5, b) == pytest.approx(0.1)
    assert histogram_quantile(0.75, b) == pytest.approx(0.55)
    assert histogram_quantile(0.25, b) == pytest.approx(0.05)
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # in +Inf: the last bound


def test_metrics_delta_takes_quantiles_of_the_difference_summed_over_clusters():
    before = parse_prometheus(PROM % (5, 5, 5, 5, 2))
    after = parse_prometheus(PROM % (5, 15, 15, 15, 3))  # 10 new requests, all between 0.1 and 1 s
    d = metrics_delta(before, after)
    assert d["scheduling_delay_s"]["count"] == 10
    assert d["scheduling_delay_s"]["p50"] == pytest.approx(0.55)
    assert d["preemptions"] == 1


def test_attainment_capacity_counts_requests_meeting_their_own_slos():
    """The attainment definition judges each request by its own P99 gap; the paper's pools every gap."""
    records = [rec(i, 0.0, 0.5, [0.1] * 20) for i in range(9)] + [rec(9, 0.0, 0.5, [0.1] * 19 + [0.9])]
    assert slo_attainment(records, ttft_slo=1.0, tbt_slo=0.5) == pytest.approx(0.9)
    assert slo_attainment(records, ttft_slo=0.4, tbt_slo=0.5) == 0.0  # every TTFT is 0.5 s
    s = summarize(records, Slo(ttft_p99=1.0, tbt_p99=0.5))
    s["attainment"] = {"0.5": slo_attainment(records, 1.0, 0.5)}
    assert meets_attainment(s, 0.5, 0.9) and not meets_attainment(s, 0.5, 0.95)
    assert meets_capacity_slo(s, 0.5)  # one slow gap in 200 is below the pooled P99


def test_capacity_criterion_flag_picks_the_definition():
    from types import SimpleNamespace

    from stallfree.bench.capacity_cmd import criterion

    s = {"attainment": {"0.5": 0.5}, "outcomes": {"ok": 1}, "num_requests": 1,
         "tbt_s": {"p99": 0.1}, "scheduling_delay_s": {"p50": 0.1}, "ttft_s": {"p50": 0.1}}  # fmt: skip
    paper = criterion(SimpleNamespace(capacity_definition="paper", slo_delay=2.0, attainment=0.9))
    attain = criterion(SimpleNamespace(capacity_definition="attainment", slo_delay=2.0, attainment=0.9))
    assert paper(s, 0.5) and not attain(s, 0.5)
