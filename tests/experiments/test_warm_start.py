"""experiments.warm_start's split of a run into the first requests after readiness and the rest."""

from __future__ import annotations

from experiments.warm_start import window_figures
from stallfree.bench.metrics import OK, SLO, RequestRecord


def _record(index: int, ttft: float, gap: float) -> RequestRecord:
    times = [ttft + i * gap for i in range(5)]
    return RequestRecord(index, 10, 5, arrival=0.0, outcome=OK, sent=0.0, first_token=ttft,
                         finish=times[-1], token_times=times, output_tokens=5)  # fmt: skip


def test_the_first_window_is_split_by_arrival_order_not_by_list_order():
    slo = SLO(ttft=1.0, tbt=0.5)
    # the first 4 requests (by index) are slow to start, the rest are fine; listed out of order
    records = [
        _record(i, 2.0 if i < 4 else 0.1, 0.1 if i < 4 else 0.2) for i in (7, 0, 5, 2, 9, 1, 3, 4, 6, 8)
    ]
    out = window_figures(records, 4, slo)
    assert out["first"]["requests"] == 4 and out["rest"]["requests"] == 6
    assert out["first"]["attainment"] == 0.0 and out["rest"]["attainment"] == 1.0
    assert abs(out["first"]["median_tbt_s"] - 0.1) < 1e-9 and abs(out["rest"]["median_tbt_s"] - 0.2) < 1e-9
    assert out["first"]["ok"] == 4
