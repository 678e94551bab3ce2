"""`bench serve` against a real `stallfree serve` (subprocess on a free port): records complete and consistent.

One server for the module, with an extra traffic cluster `tight` (maxWaiting=1, maxRunning=1) so a burst
sent to it must meet 429s, which the load generator has to record as rejected, never drop.
"""

from __future__ import annotations

import json

import pytest

from stallfree.bench import cli
from stallfree.bench.launcher import ServerProcess, ServerSpec, iteration_log_args
from stallfree.bench.metrics import OK, REJECTED
from stallfree.bench.serve_cmd import bench_once, reset_prefix_cache
from stallfree.bench.traces import TraceRequest, Workload
from stallfree.slo import Slo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    spec = ServerSpec(policy="sarathi", token_budget=64, max_num_seqs=8, num_kv_blocks=256,
                      extra_args=["--traffic-cluster", "name=tight,header=tight,maxWaiting=1,maxRunning=1",
                                  *iteration_log_args(True, folder, "e2e")])  # fmt: skip
    with ServerProcess(spec, folder / "server.log") as s:
        s.iteration_log = folder / "iterations-e2e.jsonl"
        yield s


def workload(lengths, gap):
    reqs = tuple(TraceRequest(i, p, o, i * gap) for i, (p, o) in enumerate(lengths))
    return Workload("test", 1.0, 8192, 0, 1 / gap, reqs, 0)


def test_records_are_complete_and_consistent(server):
    wl = workload([(90, 6), (20, 9), (150, 4), (40, 7)], gap=0.3)
    summary, records = bench_once(server.url, wl, Slo(ttft_p99=60, tbt_p99=30), progress=False)
    assert [r.index for r in records] == [0, 1, 2, 3]
    for r, req in zip(records, wl.requests, strict=True):
        assert r.outcome == OK and r.status_code == 200, r.error
        assert r.output_tokens == req.output_tokens  # max_tokens with ignore_eos, confirmed by usage
        assert len(r.token_times) == req.output_tokens  # one chunk per token (logprobs)
        assert r.sent >= r.arrival - 0.05  # open loop: sent on time
        assert r.sent < r.first_token == r.token_times[0] <= r.token_times[-1] <= r.finish
        assert r.ttft > 0 and r.e2e >= r.ttft and all(g >= 0 for g in r.tbts)
    assert summary["outcomes"] == {"ok": 4, "rejected": 0, "error": 0, "timeout": 0}
    assert summary["goodput_rps"] == pytest.approx(summary["throughput_rps"])  # loose SLOs: all good
    # The server's own histograms saw exactly this run's requests and gaps.
    srv = summary["server"]
    assert srv["scheduling_delay_s"]["count"] == 4
    assert srv["tbt_s"]["count"] == sum(req.output_tokens - 1 for req in wl.requests)
    assert summary["scheduling_delay_source"] == "server metrics"
    assert 0 <= summary["scheduling_delay_s"]["p50"] <= summary["ttft_s"]["p99"]
    # How busy the shared host was over the run (the steal share needs /proc/stat: Linux).
    assert summary["host"]["loadavg_1m"]["before"] >= 0
    assert 0 <= summary["host"]["steal_share"] <= 1 and isinstance(summary["host"]["disturbed"], bool)


def test_iteration_log_accounts_for_every_token(server):
    """`--iteration-log`: the run's iterations prefill every prompt token once and decode every other output
    token once, and each busy iteration's period is at least its own step."""
    before = len(server.iteration_log.read_text().splitlines()) if server.iteration_log.exists() else 0
    wl = workload([(70, 5), (33, 8), (120, 3)], gap=0.2)
    # the first test sent prompts with the same ids (same indices and seed): they would come from the cache
    assert reset_prefix_cache(server.url)
    summary, _ = bench_once(server.url, wl, Slo(ttft_p99=60, tbt_p99=30), progress=False)
    assert summary["outcomes"]["ok"] == 3
    lines = server.iteration_log.read_text().splitlines()[before:]  # flushed when the engine went idle
    recs = [json.loads(x) for x in lines]
    chunks = [c for r in recs for c in r["chunks"]]
    assert sum(n for n, _, dec in chunks if not dec) == 70 + 33 + 120
    assert sum(1 for _, _, dec in chunks if dec) == (5 - 1) + (8 - 1) + (
        3 - 1
    )  # the first token ends prefill
    assert all(n <= 64 for n, _, _ in chunks)  # the token budget holds
    periods = [(r["period_s"], r["step_s"]) for r in recs if r["period_s"] is not None]
    assert periods and all(p >= s * 0.999 for p, s in periods)
    assert recs[0]["period_s"] is None  # the engine was idle before the run: that gap is not a cost


def test_429s_are_recorded_as_rejected(server):
    wl = workload([(30, 8)] * 6, gap=0.01)
    summary, records = bench_once(
        server.url, wl, Slo(ttft_p99=60, tbt_p99=30), traffic_cluster="tight", progress=False
    )
    outcomes = [r.outcome for r in records]
    assert set(outcomes) <= {OK, REJECTED} and REJECTED in outcomes and OK in outcomes
    for r in records:
        if r.outcome == REJECTED:
            assert r.status_code == 429 and r.first_token is None and "429" in r.error
    assert summary["outcomes"]["rejected"] == outcomes.count(REJECTED)
    assert summary["good_fraction"] < 1


def test_bench_serve_command_writes_records_summary_and_plot(server, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{40 + 9 * i},{3 + i % 4}\n" for i in range(20))
    )
    rc = cli.main(["serve", "--url", server.url, "--trace", str(trace), "--scale", "0.5", "--qps", "4",
                   "--num-requests", "5", "--slo-ttft", "60", "--slo-tbt", "30", "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    records = json.loads((tmp_path / "o" / "records.json").read_text())
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert len(records) == 5 and all(r["outcome"] == "ok" for r in records)
    assert summary["workload"]["scale"] == 0.5 and summary["workload"]["num_requests"] == 5
    assert (tmp_path / "o" / "serve.png").stat().st_size > 0
    assert "goodput/s" in capsys.readouterr().out


def test_bench_sweep_runs_each_budget_on_one_server(tmp_path):
    """`bench sweep` starts its own server and changes the budget between runs (PATCH /admin/v1/config)."""
    trace = tmp_path / "t.csv"
    trace.write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{60 + 7 * i},{3 + i % 3}\n" for i in range(10))
    )
    out = tmp_path / "sweep"
    rc = cli.main(["sweep", "--policies", "sarathi", "--token-budgets", "64,128", "--qps", "4", "--trace", str(trace),
                   "--scale", "1", "--num-requests", "3", "--slo-tbt", "30", "--slo-ttft", "60",
                   "--num-kv-blocks", "256", "--max-num-seqs", "8", "--out", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["policy"], r["token_budget"]) for r in rows] == [("sarathi", 64), ("sarathi", 128)]
    assert all(r["measured"]["outcomes"]["ok"] == 3 for r in rows)
    assert (out / "sweep.png").stat().st_size > 0
