"""experiments.warm_start's split of a run into the first requests after readiness and the rest."""

from __future__ import annotations

import json

import pytest

from experiments.warm_start import main, window_figures
from stallfree.bench.metrics import OK, RequestRecord
from stallfree.slo import Slo


def _record(index: int, ttft: float, gap: float) -> RequestRecord:
    times = [ttft + i * gap for i in range(5)]
    return RequestRecord(index, 10, 5, arrival=0.0, outcome=OK, sent=0.0, first_token=ttft,
                         finish=times[-1], token_times=times, output_tokens=5)  # fmt: skip


def test_the_first_window_is_split_by_arrival_order_not_by_list_order():
    slo = Slo(ttft_p99=1.0, tbt_p99=0.5)
    # the first 4 requests (by index) are slow to start, the rest are fine; listed out of order
    records = [
        _record(i, 2.0 if i < 4 else 0.1, 0.1 if i < 4 else 0.2) for i in (7, 0, 5, 2, 9, 1, 3, 4, 6, 8)
    ]
    out = window_figures(records, 4, slo)
    assert out["first"]["requests"] == 4 and out["rest"]["requests"] == 6
    assert out["first"]["attainment"] == 0.0 and out["rest"]["attainment"] == 1.0
    assert abs(out["first"]["median_tbt_s"] - 0.1) < 1e-9 and abs(out["rest"]["median_tbt_s"] - 0.2) < 1e-9
    assert out["first"]["ok"] == 4


@pytest.mark.slow
def test_replay_sends_the_same_first_window_again_to_the_warm_server(tmp_path, capsys):
    """--replay on the real bundled model over HTTP: the fresh server's first window and the same requests
    again after its prefix cache was emptied, both reported and all answered."""
    out = tmp_path / "ws"
    argv = ["--qps", "8", "--num-requests", "5", "--window", "3", "--seeds", "0", "--token-budget", "64",
            "--threads", "1", "--replay", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads((out / "warm_start.json").read_text())["results"]["stallfree-s0"]
    assert r["first"]["requests"] == r["replay"]["requests"] == 3
    assert r["first"]["ok"] == r["replay"]["ok"] == 3 and r["rest"]["ok"] == 2
    assert "first again, warm:" in capsys.readouterr().out
