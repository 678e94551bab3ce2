"""--load-format dummy / --shape on the benchmark commands: `stallfree profile` builds the random model
itself; `stallfree bench capacity|sweep` pass the flags to the `stallfree serve` processes they start."""

from __future__ import annotations

import json

import pytest

from stallfree.bench import cli, profile
from stallfree.bench.launcher import ServerSpec
from stallfree.engine.serve_cli import build_configs, build_parser

TINY = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.mark.parametrize("argv", [["capacity", "--help"], ["sweep", "--help"]])
def test_bench_help_mentions_the_load_format(argv, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    out = capsys.readouterr().out
    assert "--load-format" in out and "--shape" in out


def test_profile_help_mentions_the_load_format_device_and_dtype(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--load-format", "--shape", "--device", "--dtype"):
        assert flag in out


def test_the_launched_server_gets_the_flags():
    cmd = ServerSpec(policy="sarathi", model="llama3-8b", load_format="dummy").command(8123)
    assert cmd[:4] == [cmd[0], "-m", "stallfree", "serve"]
    engine = build_configs(build_parser().parse_args(cmd[4:]))[0]  # what `stallfree serve` makes of them
    assert (engine.load_format, engine.model) == ("dummy", "llama3-8b")
    assert "--load-format" not in ServerSpec(model="m.gguf").command(8123)


@pytest.mark.parametrize("command", ["capacity", "sweep"])
def test_bench_refuses_a_bad_shape_before_starting_servers(command, capsys):
    assert cli.main([command, "--trace", "arxiv", "--shape", "llama-3-8b"]) == 2
    assert "smollm2-135m, llama3-8b" in capsys.readouterr().err


def test_profile_refuses_contradictions(capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(["--load-format", "auto", "--shape", "llama3-8b"])
    assert e.value.code == 2 and "--shape builds random weights" in capsys.readouterr().err


def test_profile_on_a_dummy_model(tmp_path, capsys):
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = profile.main(["--shape", str(cfg), "--decodes", "0,2", "--decode-contexts", "16", "--chunks", "0,16,32",
                       "--prefill-contexts", "0", "--reps", "1", "--holdout", "0", "--out", str(out)])  # fmt: skip
    assert rc == 0
    meta = json.loads((out / "cost_model.json").read_text())  # meta fields sit beside the coefficients
    assert (meta["model"], meta["device"], meta["dtype"], meta["clock"]) == (
        "dummy-tiny",
        "cpu",
        "bfloat16",  # auto: what `stallfree serve` runs on the CPU (bf16 + int4)
        "cpu",
    )


def test_a_time_budgeted_server_gets_its_target_and_slos():
    spec = ServerSpec(policy="sarathi", token_budget=2048, time_target=0.7, slo=(0.5, 5.0))
    engine, settings = build_configs(build_parser().parse_args(spec.command(8123)[4:]))
    tunables = engine.scheduler.tunables
    assert (tunables.time_target, tunables.token_budget) == (0.7, 2048)
    default = tunables.cluster("default")
    assert (default.tbt_slo, default.ttft_slo) == (0.5, 5.0)
    pinned = ServerSpec(policy="sarathi", token_budget=256).command(8123)
    assert build_configs(build_parser().parse_args(pinned[4:]))[0].scheduler.tunables.time_target is None
