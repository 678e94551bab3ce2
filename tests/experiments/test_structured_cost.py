"""`python -m experiments.structured_cost`, cheap: both configurations run, the JSON holds what the docs quote."""

import json

from experiments.structured_cost import main


def test_structured_bench_writes_both_configurations(tmp_path, capsys):
    assert main(["--batch", "4", "--constrained", "1", "--context", "16", "--steps", "2", "--reps", "1",
                 "--out", str(tmp_path), "--no-plot"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "structured_cost.json").read_text())
    assert set(result["configs"]) == {"plain", "constrained"}
    for cfg in result["configs"].values():
        assert cfg["iterations"] == 2
        assert 0 < cfg["ms_per_token"]["min"] <= cfg["ms_per_token"]["median"] <= cfg["ms_per_token"]["max"]
    ratio = (
        result["configs"]["constrained"]["ms_per_token"]["median"]
        / result["configs"]["plain"]["ms_per_token"]["median"]
    )
    assert result["ratio"] == ratio
    assert "ratio constrained/plain" in capsys.readouterr().out
