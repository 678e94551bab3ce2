"""experiments.llamacpp.capacity_table: a search and a later lower run of the same sample are one sample."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.llamacpp.capacity_table import load_search, merge


def _search(folder: Path, attainments: dict[float, float]) -> Path:
    runs = {
        str(q): {
            "attainment": {"0.5": att},
            "tbt_s": {"p50": 0.05, "p99": 0.4},
            "ttft_s": {"p50": 1.0},
            "host": {"busy_share": 0.5},
        }  # fmt: skip
        for q, att in attainments.items()
    }
    measured = {"by_tbt_slo": {"0.5": {"capacity_qps": 0.0, "bracket": [0.0, 0.5]}}, "runs": runs}
    folder.mkdir(parents=True)
    (folder / "capacity.json").write_text(
        json.dumps({"args": {"seed": 0}, "results": {"peer": {"measured": measured}}})
    )
    return folder


def test_runs_of_one_sample_merge_and_capacity_is_below_the_lowest_failure(tmp_path: Path):
    first = _search(tmp_path / "np8-s1", {1.0: 0.02, 0.5: 0.08})
    lower = _search(tmp_path / "np8-s1-lo", {0.25: 0.95})
    other = _search(tmp_path / "np8-s2", {1.0: 0.0, 0.5: 0.95, 0.75: 0.5})
    merged = merge([load_search(f, "0.5") for f in (first, lower, other)], 0.9)
    by_seed = {m["seed"]: m for m in merged}
    assert sorted(by_seed) == [1, 2] and all(m["label"] == "np8" for m in merged)
    assert [r["qps"] for r in by_seed[1]["runs"]] == [0.25, 0.5, 1.0]
    assert by_seed[1]["capacity_qps"] == 0.25 and by_seed[1]["fails_at"] == 0.5
    assert by_seed[2]["capacity_qps"] == 0.5 and by_seed[2]["fails_at"] == 0.75


def test_a_pass_above_a_failure_does_not_count(tmp_path: Path):
    noisy = _search(tmp_path / "sf-s3", {0.25: 0.95, 0.5: 0.5, 1.0: 0.92})
    (m,) = merge([load_search(noisy, "0.5")], 0.9)
    assert m["capacity_qps"] == 0.25 and m["fails_at"] == 0.5


def test_a_sample_that_fails_every_run_has_capacity_zero(tmp_path: Path):
    only = _search(tmp_path / "np16-s0", {1.0: 0.0, 0.5: 0.1})
    (m,) = merge([load_search(only, "0.5")], 0.9)
    assert m["capacity_qps"] == 0.0 and m["fails_at"] == 0.5
