"""The GPU cost model fitted to engine-bench figures (`stallfree profile --from-figures`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from costmodel_factories import Chunk

from stallfree.bench import figuresfit, profile
from stallfree.costmodel.features import DECODE_KV, GEMM_EXCESS, iteration_features, synthetic_features
from stallfree.costmodel.fitted import FittedCostModel

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "docs" / "figures" / "gpu" / "engine.json"
# A GPU-shaped truth (seconds): 5 ms per iteration, 15 us per decode, 46 ns per key read, 3 ns per
# prefill query-key pair, 2 ms per chunk, 19 us per GEMM row past 190 rows.
TRUTH = {"const": 5e-3, "decode_tokens": 1.5e-5, DECODE_KV: 4.6e-8, "prefill_attn": 3e-9,
         "prefill_chunks": 2e-3, GEMM_EXCESS: 1.9e-5}  # fmt: skip
KNEE = 190.0


def synthetic_figures(truth: dict[str, float], knee: float) -> dict:
    """An engine-bench JSON whose every figure is what `truth` predicts for the iterations it times."""
    model = FittedCostModel(dict(truth), gemm_knee=knee)
    doc = {"backend": "triton", "matmul_tflops": knee * 4.0, "bandwidth_tb_s": 4.0,
           "backends": {"triton": {"decode_ms": {"1": 1.0, "32": 1.0, "128": 1.0}, "prefill_4096_ms": 1.0,
                                   "chunked_ms": {"512": 1.0, "1024": 1.0, "2048": 1.0},
                                   "hybrid": {"chunk_alone_ms": 1.0, "hybrid_ms": 1.0}}}}  # fmt: skip
    row = doc["backends"]["triton"]
    timed, _ = figuresfit.observations(doc, knee)
    ms = [model.predict(r["features"]) * 1e3 for r in timed]
    row["decode_ms"] = dict(zip(row["decode_ms"], ms[:3], strict=True))
    row["prefill_4096_ms"] = ms[3]
    row["chunked_ms"] = dict(zip(row["chunked_ms"], ms[4:7], strict=True))
    row["hybrid"] = {"decodes": 32, "chunk": 512, "chunk_alone_ms": ms[7], "hybrid_ms": ms[8]}
    # kernel breakdowns: the decode kernel's time at the profiled step, the flash kernel's
    row["launches"] = {
        "decode_32": {"gpu_ms_top_kernels": {"_decode_split_kernel": truth[DECODE_KV] * 32 * 1026 * 1e3}},
        "hybrid_32_plus_512": {"gpu_ms_top_kernels": {
            "void pytorch_flash::flash_fwd_kernel<...>": truth["prefill_attn"] * 512 * (512 + 256.5) * 1e3}},
    }  # fmt: skip
    return doc


def test_the_fit_recovers_a_known_gpu_model_from_its_figures():
    model, report = figuresfit.fit_figures(synthetic_figures(TRUTH, KNEE))
    assert report["gemm_knee_tokens"] == pytest.approx(KNEE)  # derived from matmul rate / bandwidth
    for k, v in TRUTH.items():
        assert model.coefficients[k] == pytest.approx(v, rel=1e-3), k
    assert report["fit_error"]["held_out"]["max"] < 1e-3
    assert report["fit_error"]["num_held_out"] == 9 and len(report["kernel_rows"]) == 2


def test_the_figures_each_time_the_iterations_engine_bench_ran():
    timed, kernels = figuresfit.observations(synthetic_figures(TRUTH, KNEE), KNEE)
    by = {r["name"]: r for r in timed}
    assert by["4096 prompt at budget 512"]["iterations"] == 8
    assert by["4096 prompt at budget 512"]["features"]["prefill_tokens"] == 4096
    # the GEMM term is per iteration: 8 chunks of 512 pass the knee 8 times, not 4096 - knee once
    assert by["4096 prompt at budget 512"]["features"][GEMM_EXCESS] == pytest.approx(8 * (512 - KNEE))
    assert by["decode batch 128"]["features"][GEMM_EXCESS] == 0  # below the knee: only the weight read
    hybrid = by["32 decodes + 512-token chunk"]["features"]
    assert hybrid["decode_tokens"] == 32 and hybrid["prefill_tokens"] == 512
    assert hybrid["prefill_attn"] == 512 * (1536 + 256.5)  # the median timed chunk starts at 1536
    assert [set(r["features"]) for r in kernels] == [{DECODE_KV}, {"prefill_attn"}]


def test_the_plan_mirrors_engine_bench():
    engine_gpu = pytest.importorskip("experiments.engine_bench_gpu")
    plan = engine_gpu.Plan()
    assert {k: getattr(plan, k) for k in figuresfit.PLAN} == figuresfit.PLAN


def test_the_committed_h200_figures_fit_within_a_few_percent():
    model, report = figuresfit.fit_figures(figuresfit.load_figures(FIGURES))
    fe = report["fit_error"]
    assert fe["train"]["median"] < 0.08 and fe["held_out"]["median"] < 0.15
    assert model.coefficients["const"] > 0 and model.gemm_knee == pytest.approx(189, abs=5)


def test_profile_from_figures_writes_a_model_marked_as_such(tmp_path, capsys):
    figs = tmp_path / "engine.json"
    figs.write_text(json.dumps(synthetic_figures(TRUTH, KNEE)))
    rc = profile.main(["--from-figures", str(figs), "--check", str(figs), "--out", str(tmp_path / "o"),
                       "--name", "gpu.json"])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "o" / "gpu.json").read_text())
    assert "not to a `stallfree profile` grid" in doc["source"] and doc["gemm_knee_tokens"] == KNEE
    loaded = FittedCostModel.load(tmp_path / "o" / "gpu.json")
    assert loaded.gemm_knee == KNEE and loaded.coefficients[GEMM_EXCESS] > 0
    assert (tmp_path / "o" / "gpu.fit.png").stat().st_size > 0
    assert "leave-one-out" in capsys.readouterr().out


def test_profile_from_figures_refuses_a_missing_backend(tmp_path, capsys):
    figs = tmp_path / "engine.json"
    figs.write_text(json.dumps(synthetic_figures(TRUTH, KNEE)))
    assert profile.main(["--from-figures", str(figs), "--backend", "torch", "--out", str(tmp_path)]) == 2
    assert "no backend 'torch'" in capsys.readouterr().err


def test_the_knee_costs_rows_only_past_it_and_a_given_excess_wins():
    m = FittedCostModel({"const": 1.0, GEMM_EXCESS: 0.5}, gemm_knee=100)
    assert m.predict(synthetic_features(50, 40)) == 1.0  # 90 rows: the weight read only
    assert m.predict(synthetic_features(100, 20)) == pytest.approx(1.0 + 0.5 * 20)
    assert m.predict({"const": 2.0, "prefill_tokens": 1000, GEMM_EXCESS: 3.0}) == pytest.approx(2.0 + 1.5)


def test_a_knee_model_round_trips_and_a_knee_term_without_a_knee_is_refused(tmp_path):
    m = FittedCostModel({"const": 1.0, GEMM_EXCESS: 0.5}, {"source": "x"}, gemm_knee=123.0)
    m.save(tmp_path / "m.json")
    back = FittedCostModel.load(tmp_path / "m.json")
    assert back.gemm_knee == 123.0 and back.meta == {"source": "x"}
    doc = json.loads((tmp_path / "m.json").read_text())
    del doc["gemm_knee_tokens"]
    (tmp_path / "m.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="gemm_knee_tokens"):
        FittedCostModel.load(tmp_path / "m.json")


def test_decode_kv_counts_each_decodes_own_history_without_padding():
    f = iteration_features([Chunk(1, 999, True), Chunk(1, 99, True), Chunk(1, 899, True)])
    assert f[DECODE_KV] == 1000 + 100 + 900
    assert f["decode_attn"] >= f[DECODE_KV]  # the torch backend's padded area
