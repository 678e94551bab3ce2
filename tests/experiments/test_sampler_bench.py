"""`python -m experiments.sampler_bench` runs, prints its table and saves every case."""

import json

from experiments.sampler_bench import main


def test_sampler_bench_saves_every_case(tmp_path, capsys):
    assert main(["--batch", "4", "--vocab", "512", "--reps", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sampler.json").read_text())["rows"]
    cases = {(r["device"], r["temperature"], r["penalised_rows"]) for r in rows}
    assert {("cpu", 0.0, 0), ("cpu", 0.0, 1), ("cpu", 0.0, 4), ("cpu", 0.8, 4)} <= cases
    assert all(r["ratio"] == 1.0 for r in rows if r["penalised_rows"] == 0)
    assert all(r["median_ms"] > 0 for r in rows)
    assert "penalised_rows" in capsys.readouterr().out
