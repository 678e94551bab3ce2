"""`stallfree serve` as the operator runs it: --help, clear flag errors, and a real process that drains
in-flight requests on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from stallfree.engine.serve_cli import main
from stallfree.ports import free_port

STALLFREE = [sys.executable, "-m", "stallfree"]


def test_help_is_clear(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--policy", "--token-budget", "--traffic-clusters", "--admin-token",
                 "--tensor-parallel-size", "--num-kv-blocks", "STALLFREE_API_KEY"):  # fmt: skip
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tensor-parallel-size", "0"], "must be >= 1"),
        (["--pipeline-parallel-size", "0"], "must be >= 1"),
        (["--model", "/no/such/model"], "no such file"),
        (["--traffic-cluster", "name=chat,chunkCap=0"], "chunkCap must be >= 1"),
        (["--token-budget", "0"], "--token-budget must be >= 1"),
    ],
)
def test_bad_flags_fail_fast(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_bad_traffic_file_names_the_field(tmp_path, capsys):
    f = tmp_path / "engine.yaml"
    f.write_text("trafficClusters:\n  - name: a\n  - name: b\n    slo: {tbtP99Seconds: 0}\n")
    assert main(["--traffic-clusters", str(f)]) == 2
    assert "trafficClusters[1].slo.tbtP99Seconds must be > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits():
    port = free_port()
    env = {**os.environ, "STALLFREE_ADMIN_TOKEN": "t", "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(
        [*STALLFREE, "serve", "--port", str(port), "--num-kv-blocks", "128", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        result = {}

        def call():
            body = {"prompt": "Hi", "max_tokens": 24, "ignore_eos": True}
            result["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.5)  # in flight
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["usage"]["completion_tokens"] == 24, "the in-flight request was cut"
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_scheduling_flags_reach_the_engine_config():
    from stallfree.engine.serve_cli import build_configs, build_parser

    args = build_parser().parse_args(["--policy", "sarathi", "--token-budget", "96", "--chunk-align", "32"])
    config, _ = build_configs(args)
    assert config.scheduler.hybrid_batching is True
    assert config.scheduler.tunables.token_budget == 96 and config.scheduler.chunk_align == 32
    assert config.scheduler.chunk_context_scale is None  # off unless asked for
    config, _ = build_configs(build_parser().parse_args(["--chunk-context-scale", "1331"]))
    assert config.scheduler.chunk_context_scale == 1331
    args = build_parser().parse_args(["--no-hybrid-batching"])
    config, _ = build_configs(args)
    assert config.scheduler.hybrid_batching is False  # the paper's chunking-only ablation


def test_served_names_survive_traffic_cluster_flags():
    """--served-model-name and --traffic-cluster together: the served names stay the ordered tuple given."""
    from stallfree.engine.serve_cli import build_configs, build_parser

    argv = ["--served-model-name", "b", "a", "--traffic-cluster", "name=chat,chunkCap=64"]
    _, settings = build_configs(build_parser().parse_args(argv))
    assert settings.served_model_names == ("b", "a")


def test_attention_backend_and_enforce_eager_reach_the_engine_config():
    from stallfree.engine.serve_cli import build_configs, build_parser

    config, _ = build_configs(build_parser().parse_args([]))
    assert config.attention_backend == "auto" and config.cuda_graphs is True
    config, _ = build_configs(build_parser().parse_args(["--attention-backend", "triton", "--enforce-eager"]))
    assert config.attention_backend == "triton" and config.cuda_graphs is False


def test_prefix_caching_flag_reaches_the_engine_config():
    """On by default; the operator passes one of the two forms (spec.engine.prefixCaching)."""
    from stallfree.engine.serve_cli import build_configs, build_parser

    assert build_configs(build_parser().parse_args([]))[0].cache.enable_prefix_caching is True
    for flag, on in (("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)):
        config, _ = build_configs(build_parser().parse_args([flag]))
        assert config.cache.enable_prefix_caching is on


def test_cpu_default_is_bf16_int4_and_fp32_is_one_flag_away(monkeypatch):
    """The default CPU configuration is the fastest one with >= 90% greedy agreement (docs/engine.md). serve
    passes auto on and the engine resolves it as LLM() does (stallfree.engine.placement); impossible
    combinations fail here, before the server starts."""
    from stallfree.engine.placement import resolve_placement
    from stallfree.engine.serve_cli import build_configs, build_parser

    parse = build_parser().parse_args

    def placement(argv):
        c, _ = build_configs(parse(argv))
        p = resolve_placement(c.device, c.dtype, c.quantization, world_size=c.parallel.world_size)
        return str(p.dtype).removeprefix("torch."), p.quantization

    config, _ = build_configs(parse(["--device", "cpu"]))
    assert (config.dtype, config.quantization) == ("auto", "auto")
    assert placement(["--device", "cpu"]) == ("bfloat16", "int4")
    assert placement(["--device", "cpu", "--dtype", "float32"]) == ("float32", "none")
    assert placement(["--device", "cpu", "--quantization", "none"]) == ("bfloat16", "none")
    with pytest.raises(ValueError, match="bf16"):
        build_configs(parse(["--device", "cpu", "--dtype", "float32", "--quantization", "int4"]))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert build_configs(parse(["--device", "cpu"]))[0].threads == 3
    assert build_configs(parse(["--device", "cpu", "--threads", "1"]))[0].threads == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert build_configs(parse(["--device", "cpu"]))[0].threads == len(os.sched_getaffinity(0))
