"""The accuracy protocol (scripts/sim-accuracy --evaluate) on a folder whose measurements are simulator runs
and whose iteration logs are drawn from the same cost model: every served fit then recovers that model, so
its predictions equal the measurements, while a grid profile twice as slow over-predicts every gap. The
leave-one-out rows must score each server with a model that never saw its summarization log."""

from __future__ import annotations

import json
import random

from costmodel_factories import make_cost_model
from test_sim_accuracy import fake_capacity_json

from experiments import sim_accuracy_protocol as accuracy_protocol
from stallfree.bench.servedfit import Shape
from stallfree.costmodel.features import iteration_features


def write_log(path, cost, seed: int, n: int = 300) -> None:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        chunks = [Shape(1, rng.randint(20, 900), True) for _ in range(rng.randint(0, 24))]
        if rng.random() < 0.6 or not chunks:
            chunks.append(Shape(rng.choice([32, 128, 256, 512]), rng.choice([0, 256, 1024]), False))
        t = cost.predict(iteration_features(chunks))
        lines.append(json.dumps({"chunks": [list(c) for c in chunks], "period_s": t, "step_s": t}))
    path.write_text("\n".join(lines) + "\n")


def make_folder(tmp_path, cost, grid):
    folder = tmp_path / "acc"
    for sub in ("profile", "calib-sharegpt", "capacity-arxiv"):
        (folder / sub).mkdir(parents=True)
    grid.save(folder / "profile" / "cost_model.json")
    cap = fake_capacity_json(tmp_path, cost)
    (folder / "capacity-arxiv" / "capacity.json").write_text(json.dumps(cap, default=str))
    for k, server in enumerate(cap["results"]):
        write_log(accuracy_protocol.log_path(folder / "capacity-arxiv", server), cost, seed=k)
        write_log(accuracy_protocol.log_path(folder / "calib-sharegpt", server), cost, seed=10 + k)
    (folder / "slo.txt").write_text("strict SLO 0.2 s, budget 128\n")
    return folder


def test_served_fits_recover_the_model_and_leave_one_out_holds_each_server_out(tmp_path, capsys):
    cost = make_cost_model()
    grid = make_cost_model(**{k: 2 * v for k, v in cost.coefficients.items()})
    folder = make_folder(tmp_path, cost, grid)
    assert accuracy_protocol.main([str(folder)]) == 0
    res = json.loads((folder / "summary.json").read_text())
    models = {m["name"]: m for m in res["models"]}
    assert list(models) == ["grid", "served-chat", "loo-same-trace", "loo-with-calibration", "in-sample"]
    assert all(r["tbt_s.p99"]["error"] > 0.5 for r in models["grid"]["runs"])
    for name in ("served-chat", "loo-same-trace", "loo-with-calibration", "in-sample"):
        s = models[name]["score"]
        assert s["p99_tbt"]["runs"] > 0 and s["p99_tbt"]["within_20pct"] == s["p99_tbt"]["runs"], name
        assert abs(s["p99_tbt"]["worst_error"]) < 1e-3, name
        assert all(c["inside_bracket"] for c in s["capacity"].values()), name
    # Each held-out server is scored once, by a fit that did not read its own summarization log.
    servers = res["servers"]
    for name in ("loo-same-trace", "loo-with-calibration"):
        assert sorted({r["server"] for r in models[name]["runs"]}) == sorted(servers)
        assert sorted(models[name]["score"]["capacity"]) == sorted(servers)
        for held in servers:
            fit = json.loads(
                (folder / "fits" / f"{name}-without-{held.replace('@', '-')}" / "cost_model.json").read_text()
            )
            own = str(accuracy_protocol.log_path(folder / "capacity-arxiv", held))
            assert own not in fit["logs"] and len(fit["logs"]) == len(servers) - 1 + (
                len(servers) if name == "loo-with-calibration" else 0
            )
    assert (folder / "accuracy.png").stat().st_size > 0
    assert "P99 TBT within 20%" in capsys.readouterr().out


def test_refuses_a_folder_without_measurements(tmp_path, capsys):
    assert accuracy_protocol.main([str(tmp_path)]) == 2
    assert "scripts/sim-accuracy --measure" in capsys.readouterr().err
