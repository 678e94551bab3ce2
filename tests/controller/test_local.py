"""Local mode: the SarathiDeployment file checked against the CRD schema, and `stallfree up` end to end."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from promserver import free_port

from stallfree.local.config import LocalConfigError, load, validate

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "examples" / "local.yaml"


def doc():
    return yaml.safe_load(LOCAL.read_text())


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path):
    raw = yaml.safe_load(path.read_text())
    if raw["spec"].get("model", {}).get("source", {}).get("type") == "PersistentVolumeClaim":
        with pytest.raises(LocalConfigError, match="PersistentVolumeClaim cannot run locally"):
            validate(raw)
    else:
        assert load(path).name == raw["metadata"]["name"]


def test_local_example_shape():
    d = load(LOCAL)
    assert [c.name for c in d.spec.traffic_clusters] == ["chat", "summarization"]
    assert d.doc["spec"]["resources"]["gpuResourceName"] == "nvidia.com/gpu"  # defaults applied


def mutate(fn):
    d = doc()
    fn(d)
    return d


BAD = [
    (lambda d: d["spec"]["budget"].update(min=-1), "spec.budget.min: -1 is less than the minimum of 1"),
    (lambda d: d["spec"]["budget"].update(intial=3), "spec.budget.intial: unknown field"),
    (lambda d: d["spec"]["engine"].update(policy="fifo"), "spec.engine.policy: 'fifo' is not one of"),
    (
        lambda d: d["spec"]["budget"].update(initial=4096),
        "budget.initial must lie in [budget.min, budget.max]",
    ),
    (lambda d: d["spec"]["budget"].update(initial=250), "multiples of budget.align"),
    (lambda d: d["spec"]["budget"].update(timeTarget=1.5), "spec.budget.timeTarget: 1.5 is greater than"),
    (lambda d: d["spec"]["budget"].update(timeTarget=0), "spec.budget.timeTarget: Input should be greater"),
    (lambda d: d["spec"]["budget"].update(mode="seconds"), "spec.budget.mode: 'seconds' is not one of"),
    (
        lambda d: d["spec"].update(budget={"mode": "time"}, engine={"policy": "orca"}),
        "budget.mode time budgets sarathi's iterations",
    ),
    (
        lambda d: d["spec"]["trafficClusters"][0].update(maxRunning=99),
        "trafficClusters[0] (chat).maxRunning must not exceed",
    ),
    (lambda d: d["spec"]["trafficClusters"][1].update(chunkCap=4096), "chunkCap must not exceed budget.max"),
    (
        lambda d: d["spec"]["trafficClusters"][1]["match"].update(minPromptTokens=9000, maxPromptTokens=10),
        "minPromptTokens must be <=",
    ),
    (
        lambda d: d["spec"]["trafficClusters"].append(copy.deepcopy(d["spec"]["trafficClusters"][0])),
        "names must be unique",
    ),
    (lambda d: d["spec"]["controller"].update(windowSeconds=1), "windowSeconds"),
    (
        lambda d: d["spec"]["controller"].update(costModel={"const": 0.0, "prefillTokens": 0.002}),
        "spec.controller.costModel.const: Input should be greater than 0",
    ),
    (
        lambda d: d["spec"]["controller"].update(costModel={"const": 0.05, "decodeAttn": -1.0}),
        "spec.controller.costModel.decodeAttn: -1.0 is less than the minimum of 0",
    ),
    (
        lambda d: d["spec"]["slo"].update(ttftP99Seconds=0.1, tbtP99Seconds=0.2),
        "slo.ttftP99Seconds must be at least",
    ),
    (lambda d: d["spec"]["replicas"].update(min=3, max=1), "replicas.min must be <= replicas.max"),
    (lambda d: d["metadata"].update(name="Bad_Name"), "metadata.name must be a DNS label"),
    (lambda d: d.update(kind="Deployment"), "apiVersion/kind must be"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_files_name_the_field(change, message):
    with pytest.raises(LocalConfigError) as e:
        validate(mutate(change))
    assert message in str(e.value)


def test_up_help_and_bad_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stallfree", "up", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--prometheus" in out.stdout and "--admin-token" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mutate(lambda d: d["spec"]["budget"].update(min=-1))))
    out = subprocess.run([sys.executable, "-m", "stallfree", "up", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "spec.budget.min" in out.stderr


def test_a_missing_host_path_model_is_refused_before_anything_starts(tmp_path):
    d = doc()
    d["spec"]["model"]["source"] = {"type": "HostPath", "path": str(tmp_path / "missing.gguf")}
    with pytest.raises(LocalConfigError, match=r"spec.model.source.path: .*missing.gguf does not exist"):
        validate(d)


@pytest.mark.slow
def test_up_exits_when_the_engines_cannot_start(tmp_path):
    """A model file the engine cannot load: the replica exits, is restarted, keeps exiting, and `up` ends
    with exit code 1 and the replica's log, instead of answering 503 for ever."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is not a GGUF file")
    d = doc()
    d["spec"]["model"]["source"] = {"type": "HostPath", "path": str(broken)}
    f = tmp_path / "broken.yaml"
    f.write_text(yaml.safe_dump(d))
    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "up", str(f), "--port", str(free_port()), "--no-view"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "keeps exiting" in out.stderr and "replica-0.log" in out.stderr


@pytest.mark.slow
def test_up_serves_streams_reports_status_and_stops_children(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "up", str(LOCAL), "--port", str(port), "--no-view"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("stallfree up never became ready")
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
            extra_headers={"x-traffic-cluster": "chat"},
        )  # fmt: skip
        assert r.choices[0].message.content
        chunks = list(
            client.completions.create(
                model="SmolLM2-135M-Instruct", prompt="Paris is", max_tokens=5, stream=True
            )
        )
        assert len(chunks) >= 2
        time.sleep(6)  # one control interval
        status = httpx.get(f"{base}/admin/v1/status").json()
        assert status["phase"] == "Ready" and status["budget"]["tokenBudget"] == 256
        assert {c["name"] for c in status["trafficClusters"]} == {"chat", "summarization"}
        assert "stallfree_controller_decisions_total" in httpx.get(f"{base}/metrics").text
        engines = [e["url"] for e in status["engines"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    for url in engines:  # children are gone
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


def test_model_name_and_max_model_len_reach_the_engine(tmp_path):
    """spec.model.name becomes the engine's --served-model-name (what clients send as `model`, as in the
    cluster) and spec.model.maxModelLen its --max-model-len: parsed by `stallfree serve` itself."""
    from stallfree.engine.serve_cli import build_configs, build_parser
    from stallfree.local.engines import EngineFleet

    spec = load(LOCAL).spec.model_copy(
        update={"model": load(LOCAL).spec.model.model_copy(update={"name": "my-chat", "max_model_len": 4096})}
    )
    fleet = EngineFleet("d", spec, tmp_path, tmp_path / "engine.yaml", "token", 60.0)
    (tmp_path / "engine.yaml").write_text("tokenBudget: 256\n")
    cmd = fleet.command(free_port())
    assert cmd[cmd.index("--served-model-name") + 1] == "my-chat"
    engine_config, settings = build_configs(build_parser().parse_args(cmd[cmd.index("serve") + 1 :]))
    assert settings.served_model_names == ("my-chat",) and engine_config.max_model_len == 4096


def test_budget_chunk_context_scale_reaches_the_engine_scheduler(tmp_path):
    """spec.budget.chunkContextScale becomes `stallfree serve --chunk-context-scale`, parsed by serve itself
    into the scheduler's config; unset, the engine keeps the plain count."""
    from stallfree.engine.serve_cli import build_configs, build_parser
    from stallfree.local.engines import EngineFleet

    base = load(LOCAL).spec
    (tmp_path / "engine.yaml").write_text("tokenBudget: 256\n")
    for scale in (None, 1331):
        spec = base.model_copy(
            update={"budget": base.budget.model_copy(update={"chunk_context_scale": scale})}
        )
        cmd = EngineFleet("d", spec, tmp_path, tmp_path / "engine.yaml", "token", 60.0).command(free_port())
        engine_config, _ = build_configs(build_parser().parse_args(cmd[cmd.index("serve") + 1 :]))
        assert engine_config.scheduler.chunk_context_scale == scale


PROFILE = {"const": 0.0588, "prefillTokens": 0.00257, "decodeTokens": 0.00441}


@pytest.mark.parametrize(
    "budget, mode, target, cap",
    [
        ({"initial": 256, "min": 64, "max": 1024, "align": 32}, "tokens", None, 256),
        ({"min": 64, "max": 1024, "align": 32}, "time", 0.8, 1024),
        ({"mode": "time", "timeTarget": 0.6, "initial": 256, "max": 1024}, "time", 0.6, 1024),
    ],
    ids=["initial-pinned", "time-default", "time-explicit"],
)
def test_budget_mode_reaches_the_engine_scheduler(tmp_path, budget, mode, target, cap):
    """spec.budget's mode becomes `stallfree serve`'s budget flags, parsed by serve itself with the
    engine.yaml local mode writes: tokens mode a fixed token budget, time mode the time target with the
    cap (budget.max), and spec.controller.costModel the engines' --cost-model prior (time mode only)."""
    import shutil

    import stallfree.local.run as run_mod
    from stallfree.engine.serve_cli import build_configs, build_parser
    from stallfree.local import build_parser as up_parser

    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(mutate(lambda d: d["spec"].update(
        budget=budget, controller={**d["spec"].get("controller", {}), "costModel": PROFILE}))))  # fmt: skip
    dep = load(path)
    assert dep.spec.budget_mode == mode
    run = run_mod.LocalRun(dep, up_parser().parse_args([str(path)]), None)
    try:
        cmd = run.fleet.command(free_port())
        engine_config, settings = build_configs(build_parser().parse_args(cmd[cmd.index("serve") + 1 :]))
        tunables = engine_config.scheduler.tunables
        assert (tunables.time_target, tunables.token_budget) == (target, cap)
        assert settings.traffic.time_target == target
        if target is None:
            assert engine_config.cost_model is None and "--time-target" not in cmd
        else:
            prior = yaml.safe_load(Path(engine_config.cost_model).read_text())
            assert prior["coefficients"]["prefill_tokens"] == 0.00257
        status = run.status()["budget"]
        assert status["mode"] == mode and status.get("timeTarget") == target
    finally:
        run.fleet.stop()
        shutil.rmtree(run.run_dir, ignore_errors=True)


@pytest.mark.parametrize("enabled", [True, False])
def test_spec_controller_enabled_decides_whether_local_mode_retunes(tmp_path, monkeypatch, enabled):
    """controller.enabled: false serves the spec's settings, as the kopf timer does in a cluster."""
    import shutil
    import threading

    from stallfree.local import build_parser
    from stallfree.local.run import LocalRun
    from stallfree.operator.controller.loop import ControlLoop

    path = tmp_path / "d.yaml"
    ctl = {"enabled": enabled, "intervalSeconds": 1, "windowSeconds": 5}
    path.write_text(yaml.safe_dump(mutate(lambda d: d["spec"]["controller"].update(ctl))))
    run = LocalRun(load(path), build_parser().parse_args([str(path)]), None)
    steps: list[int] = []
    monkeypatch.setattr(run.fleet, "wait_ready", lambda *a: True)
    monkeypatch.setattr(run.fleet, "check", lambda: None)
    monkeypatch.setattr(run.fleet, "endpoints", lambda: [])  # nothing to adopt settings from
    monkeypatch.setattr(ControlLoop, "step", lambda self: steps.append(1))
    t = threading.Thread(target=run._control)
    t.start()
    time.sleep(2.5)
    run.stop.set()
    t.join(5)
    shutil.rmtree(run.run_dir, ignore_errors=True)
    assert run.retunes is enabled
    assert (len(steps) >= 1) is enabled


@pytest.mark.slow
def test_an_engine_token_starting_with_a_dash_reaches_the_engine(monkeypatch):
    """Local mode's engine token is random (token_urlsafe), so one in 64 starts with "-". On the engine's
    command line argparse read it as an option and every replica exited; it now goes by environment, as
    the operator's pods get it. A real replica must start and accept that token on its admin API."""
    import shutil

    import stallfree.local.run as run_mod
    from stallfree.local import build_parser

    token = "-dash-first-token"
    monkeypatch.setattr(run_mod.secrets, "token_urlsafe", lambda n=None: token)
    run = run_mod.LocalRun(load(LOCAL), build_parser().parse_args([str(LOCAL)]), None)
    try:
        assert run.engine_token == token and token not in run.fleet.command(free_port())
        run.fleet.scale_to(1)
        assert run.fleet.wait_ready(240), "the replica never became ready"
        (base,) = run.fleet.endpoints()
        ok = httpx.get(f"{base}/admin/v1/config", headers={"authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["tokenBudget"] > 0, ok.text
        assert httpx.get(f"{base}/admin/v1/config").status_code == 401
    finally:
        run.fleet.stop()
        shutil.rmtree(run.run_dir, ignore_errors=True)


def test_a_hub_source_reaches_serve_as_its_uri():
    """Local mode hands an hf:// source to `stallfree serve`, which downloads it once into the local model
    cache (engine/hub.py); the served name and length limit come from the spec as in a cluster."""
    import shutil

    import stallfree.local.run as run_mod
    from stallfree.local import build_parser

    example = REPO / "examples" / "llama-3.1-8b-hf.yaml"
    run = run_mod.LocalRun(load(example), build_parser().parse_args([str(example)]), None)
    try:
        cmd = run.fleet.command(free_port())
        assert cmd[cmd.index("--model") + 1] == "hf://meta-llama/Llama-3.1-8B-Instruct@main"
        assert cmd[cmd.index("--max-model-len") + 1] == "8192"
    finally:
        run.fleet.stop()
        shutil.rmtree(run.run_dir, ignore_errors=True)
