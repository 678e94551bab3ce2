"""`python -m experiments.sim_accuracy` on a capacity.json whose "measurements" are themselves simulator runs with the
same cost model: every prediction must then equal its measurement, and each predicted capacity must lie in
its measured bracket. A second cost model twice as slow must show up as errors of the right sign."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench_factories import make_trace
from costmodel_factories import make_cost_model

from experiments.sim_accuracy import compare, main
from stallfree.bench.simulate import simulate_capacity
from stallfree.bench.simulator import ServerEntry, SimConfig
from stallfree.slo import Slo


def fake_capacity_json(tmp_path, cost) -> dict:
    trace = make_trace(tmp_path, prompt=1200, output=30)
    args = SimpleNamespace(
        trace=trace.path, scale=1.0, max_model_len=8192, num_requests=30, seed=0, slo_ttft=60.0,
        slo_delay=2.0, token_budget=256, max_num_seqs=128, num_kv_blocks=None, chunk_align=0,
        overhead_ms=0.0, start_qps=0.25, tolerance=0.25,
    )  # fmt: skip
    slo = Slo(ttft_p99=60.0, tbt_p99=0.2)
    results = {}
    for name, policy, budget in (("sarathi@128", "sarathi", 128), ("vllm", "vllm", 256)):
        cfg = SimConfig(policy=policy, token_budget=budget)
        results[name] = {"measured": simulate_capacity(trace, args, cost, cfg, [0.2, 1.0], slo), "server": []}
    return {"args": vars(args), "results": results}


def test_the_simulator_agrees_with_itself(tmp_path):
    cost = make_cost_model()
    res = compare(fake_capacity_json(tmp_path, cost), cost)
    assert res["runs"] and all(abs(r["tbt_s.p99"]["error"]) < 1e-9 for r in res["runs"])
    assert res["p99_tbt_summary"]["within_20pct"] == res["p99_tbt_summary"]["runs"]
    assert res["capacity"] and all(c["inside_bracket"] for c in res["capacity"])


def test_a_slower_model_predicts_longer_gaps_and_less_capacity(tmp_path):
    cost = make_cost_model()
    slow = make_cost_model(**{k: 2 * v for k, v in cost.coefficients.items()})
    res = compare(fake_capacity_json(tmp_path, cost), slow)
    assert all(r["tbt_s.p99"]["error"] > 0.5 for r in res["runs"])
    assert all(c["predicted"] <= c["measured_bracket"][0] for c in res["capacity"])


def test_command_writes_json_and_refuses_a_missing_file(tmp_path, capsys):
    cost = make_cost_model()
    (tmp_path / "cap.json").write_text(json.dumps(fake_capacity_json(tmp_path, cost), default=str))
    cost.save(tmp_path / "cm.json")
    out = tmp_path / "acc"
    assert main([str(tmp_path / "cap.json"), "--cost-model", str(tmp_path / "cm.json"),
                     "--out", str(out)]) == 0  # fmt: skip
    assert "within 20%" in capsys.readouterr().out
    assert json.loads((out / "accuracy.json").read_text())["runs"]
    assert main([str(tmp_path / "none.json"), "--cost-model", str(tmp_path / "cm.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_capacity_and_sweep_commands_simulate_the_same_configuration(tmp_path):
    """The simulator columns of `bench capacity` and `bench sweep` (shared sim_config): same server knobs,
    and the entry's own budget, as `bench accuracy` uses."""
    from stallfree.bench import capacity_cmd, sweep_cmd

    cost = make_cost_model()
    cost.save(tmp_path / "cm.json")
    trace = make_trace(tmp_path, prompt=1200, output=30)
    args = SimpleNamespace(
        cost_model=str(tmp_path / "cm.json"), contention="1", max_num_seqs=128, num_kv_blocks=None,
        max_model_len=8192, chunk_align=0, overhead_ms=0.0, num_requests=20, qps=0.5, scale=1.0, seed=0,
        start_qps=0.25, tolerance=0.25, slo_delay=2.0,
    )  # fmt: skip
    slo = Slo(ttft_p99=60.0, tbt_p99=0.2)
    small = capacity_cmd.simulated(ServerEntry("sarathi", 128), trace, args, [0.2], slo)
    large = capacity_cmd.simulated(ServerEntry("sarathi", 2048), trace, args, [0.2], slo)
    assert small["by_tbt_slo"]["0.2"]["capacity_qps"] > large["by_tbt_slo"]["0.2"]["capacity_qps"]
    p_small = sweep_cmd._predict("sarathi", 128, trace, args, slo)
    p_large = sweep_cmd._predict("sarathi", 2048, trace, args, slo)
    assert p_small["tbt_s"]["p99"] < p_large["tbt_s"]["p99"]
    args.cost_model = None
    assert capacity_cmd.simulated(ServerEntry("sarathi", 128), trace, args, [0.2], slo) is None
