"""The commands end to end on small inputs: tune, simulate, profile (real model, tiny grid), help texts."""

from __future__ import annotations

import json

import pytest
from bench_factories import write_trace
from costmodel_factories import make_cost_model

from stallfree.bench import cli, profile, simulate, tune


def test_tune_picks_the_largest_aligned_budget_under_the_slo():
    cost = make_cost_model()
    res = tune.tune(cost, 0.2, decodes=16, decode_context=256, prompt_len=1024, align=32, margin=1.0)
    b = res["token_budget"]
    assert b % 32 == 0
    assert (
        tune.worst_iteration(cost, b, 16, 256, 1024)
        <= 0.2
        < tune.worst_iteration(cost, b + 32, 16, 256, 1024)
    )
    small = next(r for r in res["budgets"] if r["budget"] == 128)
    assert (
        small["prefill_s"] > res["chosen"]["prefill_s"] >= res["one_shot_prefill_s"]
    )  # smaller chunks cost TTFT
    assert not tune.tune(cost, 0.01, decodes=16, decode_context=256, prompt_len=1024)["feasible"]


def test_tune_with_a_context_scale_checks_every_chunk_and_affords_a_larger_budget():
    cost = make_cost_model(prefill_attn=1e-6)  # a token's attention as dear as the rest of it at 500 context
    scale = tune.context_scale(cost)
    assert scale == pytest.approx(500, rel=0.02)
    kw = {"decodes": 16, "decode_context": 256, "prompt_len": 2048, "align": 32, "margin": 1.0}
    plain, charged = tune.tune(cost, 0.2, **kw), tune.tune(cost, 0.2, scale=scale, **kw)
    b = charged["token_budget"]
    assert b > plain["token_budget"]
    # the charged budget's every chunk of the prompt meets the SLO, the next budget's does not
    times = [cost.iteration_time(n, 16, s, 256) for s, n in tune.chunk_starts(b, 16, 2048, scale)]
    assert max(times) == charged["chosen"]["iteration_s"] <= 0.2
    assert tune.worst_iteration(cost, b + 32, 16, 256, 2048, scale) > 0.2
    # uncharged, the same budget's last chunk would not
    assert tune.worst_iteration(cost, b, 16, 256, 2048) > 0.2
    assert sum(n for _, n in tune.chunk_starts(b, 16, 2048, scale)) >= 2048
    assert tune.context_scale(make_cost_model(prefill_attn=0.0)) is None


def test_tune_and_simulate_commands_write_json_and_plots(tmp_path, capsys):
    cost_path = tmp_path / "cost.json"
    make_cost_model().save(cost_path)
    trace = write_trace(tmp_path / "t.csv", [(300 + 7 * i, 10 + i % 7) for i in range(50)])
    assert (
        tune.main(["--tbt-slo", "0.2", "--cost-model", str(cost_path), "--out", str(tmp_path / "tune")]) == 0
    )
    assert (tmp_path / "tune" / "tune.png").stat().st_size > 0
    assert "serve with: stallfree serve --token-budget" in capsys.readouterr().out
    argv = ["--tbt-slo", "0.2", "--cost-model", str(cost_path), "--out", str(tmp_path / "tune2")]
    assert tune.main([*argv, "--chunk-context-scale", "auto"]) == 0
    assert "--chunk-context-scale 5" in capsys.readouterr().out
    assert json.loads((tmp_path / "tune2" / "tune.json").read_text())["chunk_context_scale"] > 4000
    assert tune.main([*argv, "--chunk-context-scale", "-3"]) == 2
    assert "positive integer" in capsys.readouterr().err
    rc = simulate.main(["--trace", str(trace), "--cost-model", str(cost_path), "--policy", "sarathi,vllm",
                        "--token-budget", "128,256", "--num-requests", "30", "--qps", "1", "--slo-tbt", "0.1,0.5",
                        "--capacity", "--target-qps", "4", "--out", str(tmp_path / "sim")])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    assert [(r["policy"], r["token_budget"]) for r in data["results"]] == [
        ("sarathi", 128),
        ("sarathi", 256),
        ("vllm", 128),
    ]
    plan = data["results"][0]["replica_plan"]["0.5"]
    assert plan["replicas"] >= 1 and plan["per_replica_check"]["qps"] == pytest.approx(4 / plan["replicas"])
    assert (tmp_path / "sim" / "simulate.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "cap@100ms" in out and "replicas@500ms" in out


def test_bad_input_is_refused_with_a_message(tmp_path, capsys):
    assert simulate.main(["--cost-model", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2
    assert "stallfree profile" in capsys.readouterr().err
    assert cli.main(["serve", "--url", "http://x", "--trace", str(tmp_path / "no.csv")]) == 2
    assert "not found" in capsys.readouterr().err
    # A bad policy is reported from the arguments alone: the trace here does not even exist.
    assert cli.main(["capacity", "--trace", str(tmp_path / "no.csv"), "--policies", "sarathi@x"]) == 2
    assert "sarathi@x" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["serve", "--help"], ["capacity", "--help"], ["sweep", "--help"]],
)
def test_bench_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0 and "usage: stallfree bench" in capsys.readouterr().out


@pytest.mark.slow
def test_profile_on_the_real_model_with_a_tiny_grid(tmp_path, capsys):
    rc = profile.main(["--dtype", "float32", "--quantization", "none", "--decodes", "0,2", "--decode-contexts", "16", "--chunks", "0,16,48", "--prefill-contexts",
                       "0,32", "--reps", "1", "--holdout", "0.25", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    model = json.loads((tmp_path / "cost_model.json").read_text())
    assert model["coefficients"]["const"] > 0 and model["fit_error"]["num_held_out"] >= 1
    pts = json.loads((tmp_path / "profile.json").read_text())["points"]
    assert {(p["decodes"], p["chunk"]) for p in pts} >= {(2, 0), (0, 16), (2, 48)}
    for p in pts:  # each configuration really had the decodes and chunk it claims
        assert p["features"]["decode_tokens"] == p["decodes"]
        assert p["features"]["prefill_tokens"] == p["chunk"]
    assert (tmp_path / "profile.png").stat().st_size > 0


def test_simulate_a_shared_system_prompt_with_caching_on_and_off(tmp_path, capsys):
    cost_path = tmp_path / "cost.json"
    make_cost_model().save(cost_path)
    trace = write_trace(tmp_path / "t.csv", [(60 + 7 * i, 10 + i % 7) for i in range(50)])
    argv = ["--trace", str(trace), "--cost-model", str(cost_path), "--policy", "sarathi", "--token-budget", "256",
            "--num-requests", "30", "--qps", "0.5", "--workload", "system-prompt", "--system-prompt-tokens", "800",
            "--out", str(tmp_path / "sim")]  # fmt: skip
    assert simulate.main([*argv, "--prefix-caching", "on,off"]) == 0
    data = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    on, off = data["results"]
    assert (on["policy"], off["policy"]) == ("sarathi", "sarathi-nocache")
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    assert on["workload"]["sharing"]["system_prompt_tokens"] == 800
    assert on["summary"]["ttft_s"]["p50"] * 3 < off["summary"]["ttft_s"]["p50"]
    assert simulate.main([*argv, "--prefix-caching", "maybe"]) == 2
    assert "--prefix-caching" in capsys.readouterr().err
