"""Builders: golden manifests for representative specs, plus the contract with the engine.

Regenerate the golden files after an intended change with: STALLFREE_UPDATE_GOLDEN=1 pytest tests/operator
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest_k8s import load_example
from crd_schema import defaulted_spec

from stallfree.costmodel.fitted import FittedCostModel
from stallfree.engine.hub import parse_hub_uri
from stallfree.operator.builders import (
    BuildContext,
    Features,
    Owner,
    Tuned,
    build_children,
    engine_args,
    engine_config,
)
from stallfree.operator.builders.meta import ANNOTATION_CONFIG_HASH
from stallfree.operator.model_source import SourceFacts
from stallfree.operator.reconcile import sized_spec
from stallfree.operator.sizing import ModelShape
from stallfree.operator.spec import parse_spec

GOLDEN = Path(__file__).parent / "golden"
OWNER = Owner(name="demo", namespace="serving", uid="00000000-0000-0000-0000-000000000001")


def make_ctx(
    spec: dict,
    *,
    status: dict | None = None,
    features: Features | None = None,
    image: str = "stallfree/engine:test",
    shape: ModelShape | None = None,
    hub_endpoint: str | None = None,
) -> BuildContext:
    """A build context as the reconciler makes one; `shape` stands for what the hub said about a
    HuggingFace source (sizing then fills what the spec leaves unset)."""
    raw = defaulted_spec(spec)
    parsed = parse_spec(raw)
    facts = None
    if parsed.model.source.type == "HuggingFace":
        facts = SourceFacts(parse_hub_uri(parsed.model.source.uri), shape, "0" * 40 if shape else None)
    parsed, sizing = sized_spec(parsed, raw, facts)
    return BuildContext(
        owner=OWNER,
        spec=parsed,
        raw_spec=raw,
        engine_image=parsed.engine.image or image,
        tuned=Tuned.from_status(status),
        features=features or Features(),
        hub_endpoint=hub_endpoint,
        model=facts,
        sizing=sizing,
    )


# Llama-3.1-8B-Instruct as its config.json and safetensors files describe it.
LLAMA_8B = ModelShape(weight_bytes=16_060_522_496, layers=32, kv_heads=8, head_dim=128, context_length=131072)
HF_PASS_THROUGH = {
    "model": {
        "name": "Qwen/Qwen3-8B",
        "source": {
            "type": "HuggingFace",
            "uri": "hf://Qwen/Qwen3-8B@v1.0",
            "endpoint": "https://hub.example",
        },
        "maxModelLen": 32768,
    },
    "pod": {
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "inference",
        "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        "envFrom": [{"secretRef": {"name": "extra-env"}}],
        "volumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}}],
        "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
        ],
    },
}


def pod_template_hash(children: list[dict]) -> str:
    workload = next(c for c in children if c["kind"] == "Deployment")
    return workload["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]


MULTI_NODE = {
    "model": {"name": "Llama-3.1-405B"},
    "parallelism": {"tensor": 8, "pipeline": 2},
    "replicas": {"min": 2, "max": 2},
}
CASES = {
    "single-gpu": lambda: make_ctx(load_example("sarathideployment.yaml")["spec"]),
    "multi-cluster": lambda: make_ctx(
        load_example("multi-cluster.yaml")["spec"], features=Features(service_monitor=True)
    ),
    "multi-node-statefulsets": lambda: make_ctx(MULTI_NODE),
    "multi-node-leaderworkerset": lambda: make_ctx(MULTI_NODE, features=Features(leader_worker_set=True)),
    "huggingface-cache-claim": lambda: make_ctx(
        load_example("llama-3.1-8b-hf.yaml")["spec"], shape=LLAMA_8B, hub_endpoint="http://hub.internal"
    ),
    "huggingface-emptydir-pod-settings": lambda: make_ctx(HF_PASS_THROUGH, shape=None),
    "cpu-only-hostpath": lambda: make_ctx(
        {
            "model": {"source": {"type": "HostPath", "path": "/srv/models/smollm2"}},
            "resources": {"gpusPerPod": 0},
        }
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_manifests(case: str):
    ctx = CASES[case]()
    rendered = yaml.safe_dump_all(build_children(ctx), sort_keys=True)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("STALLFREE_UPDATE_GOLDEN") == "1" or not path.exists():
        path.write_text(rendered)
    assert rendered == path.read_text(), (
        f"{path} differs; if intended, regenerate with STALLFREE_UPDATE_GOLDEN=1"
    )


def test_engine_args_follow_the_engine_cli_contract():
    ctx = make_ctx(load_example("multi-cluster.yaml")["spec"])
    *args, caching = engine_args(ctx)
    assert caching == "--enable-prefix-caching"  # spec.engine.prefixCaching defaults to true
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--model": "/models/llama-3.1-8b-instruct",
        "--served-model-name": "Llama-3.1-8B-Instruct",  # spec.model.name, whatever the folder is called
        "--max-model-len": "16384",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--policy": "sarathi",
        "--token-budget": "512",
        "--max-num-seqs": "256",
        "--block-size": "16",
        "--dtype": "bfloat16",
        "--traffic-clusters": "/etc/stallfree/engine.yaml",
        "--tensor-parallel-size": "2",
        "--pipeline-parallel-size": "1",
    }
    assert make_ctx({"model": {}}).spec.model.name == "SmolLM2-135M-Instruct"
    assert engine_args(make_ctx({"model": {}}))[1] == "SmolLM2-135M-Instruct"
    assert "--max-model-len" not in engine_args(make_ctx({"model": {}}))  # unset: the model's own limit
    off = make_ctx({"model": {}, "engine": {"prefixCaching": False}})
    assert engine_args(off)[-1] == "--no-enable-prefix-caching"
    assert "--chunk-context-scale" not in engine_args(off)  # unset: the plain count
    charged = engine_args(make_ctx({"model": {}, "budget": {"chunkContextScale": 1331}}))
    assert charged[charged.index("--chunk-context-scale") + 1] == "1331"


PROFILE = {"const": 0.0588, "prefillTokens": 0.00257, "decodeTokens": 0.00441, "prefillAttn": 1.73e-06,
           "decodeAttn": 1.97e-05, "prefillChunks": 0.0146}  # fmt: skip


def test_time_mode_is_the_default_and_a_pinned_initial_keeps_tokens_mode():
    assert make_ctx({"model": {}}).spec.budget_mode == "time"
    assert make_ctx({"model": {}, "budget": {"initial": 256}}).spec.budget_mode == "tokens"
    assert make_ctx({"model": {}, "budget": {"initial": 256, "mode": "time"}}).spec.budget_mode == "time"
    assert make_ctx({"model": {}, "budget": {"mode": "tokens"}}).spec.budget_mode == "tokens"
    assert make_ctx({"model": {}, "engine": {"policy": "vllm"}}).spec.budget_mode == "tokens"  # a baseline
    for example in ("sarathideployment.yaml", "multi-cluster.yaml", "llama-3.1-8b-hf.yaml", "local.yaml"):
        assert parse_spec(load_example(example)["spec"]).budget_mode == "tokens"  # they pin initial


def test_time_mode_engine_args_and_config_map(tmp_path):
    """Time mode: the engines get the cap (budget.max) as --token-budget with --time-target, and engine.yaml
    carries the same; a profile in the spec becomes cost_model.json, the engines' --cost-model prior."""
    ctx = make_ctx({"model": {}, "budget": {"max": 2048, "timeTarget": 0.7}})
    args = engine_args(ctx)
    assert args[args.index("--token-budget") + 1] == "2048" and args[args.index("--time-target") + 1] == "0.7"
    assert "--cost-model" not in args
    cfg = engine_config(ctx)
    assert (cfg["tokenBudget"], cfg["timeTarget"]) == (2048, 0.7) and list(cfg) == [
        "tokenBudget",
        "timeTarget",
        "trafficClusters",
    ]
    assert set(build_children(ctx)[0]["data"]) == {"engine.yaml"}

    profiled = make_ctx({"model": {}, "controller": {"costModel": PROFILE}})
    args = engine_args(profiled)
    assert args[args.index("--cost-model") + 1] == "/etc/stallfree/cost_model.json"
    data = build_children(profiled)[0]["data"]
    doc = json.loads(data["cost_model.json"])
    assert doc["coefficients"]["const"] == 0.0588 and doc["coefficients"]["prefill_tokens"] == 0.00257
    (tmp_path / "cost_model.json").write_text(data["cost_model.json"])  # what the engine loads
    assert FittedCostModel.load(tmp_path / "cost_model.json").coefficients["decode_attn"] == 1.97e-05
    # a different profile rolls the pods (the engines read it at start)
    other = make_ctx({"model": {}, "controller": {"costModel": {**PROFILE, "const": 0.07}}})
    assert pod_template_hash(build_children(profiled)) != pod_template_hash(build_children(other))


def test_tokens_mode_renders_what_it_always_rendered():
    """A pinned budget.initial: --token-budget alone, no timeTarget, no cost_model.json (even with a
    profile: the controller plans with it, the engines run the paper's budget)."""
    ctx = make_ctx({"model": {}, "budget": {"initial": 256}, "controller": {"costModel": PROFILE}})
    args = engine_args(ctx)
    assert args[args.index("--token-budget") + 1] == "256"
    assert "--time-target" not in args and "--cost-model" not in args
    assert list(engine_config(ctx)) == ["tokenBudget", "trafficClusters"]
    assert set(build_children(ctx)[0]["data"]) == {"engine.yaml"}
    explicit = make_ctx({"model": {}, "budget": {"mode": "tokens"}})
    assert engine_config(explicit)["tokenBudget"] == 512


def test_a_tuned_time_target_reaches_the_config_map_but_does_not_roll_pods():
    spec = {"model": {}, "budget": {"max": 2048}}
    status = {"budget": {"mode": "time", "tokenBudget": 2048, "timeTarget": 0.55, "lastDecision": "lower"}}
    plain, tuned = build_children(make_ctx(spec)), build_children(make_ctx(spec, status=status))
    assert yaml.safe_load(tuned[0]["data"]["engine.yaml"])["timeTarget"] == 0.55
    assert pod_template_hash(plain) == pod_template_hash(tuned)
    above = {"budget": {"timeTarget": 0.95, "lastDecision": "raise"}}
    assert engine_config(make_ctx(spec, status=above))["timeTarget"] == 0.8  # never above the spec's
    mirror = {"budget": {"timeTarget": 0.3}}  # the operator's own mirror, no decision yet
    assert engine_config(make_ctx(spec, status=mirror))["timeTarget"] == 0.8
    # after a change of mode, what was tuned in the other mode is not carried over
    pinned = {"model": {}, "budget": {"initial": 256, "max": 2048}}
    assert engine_config(make_ctx(pinned, status={"budget": {**status["budget"]}}))["tokenBudget"] == 256
    was_tokens = {"budget": {"mode": "tokens", "tokenBudget": 1024, "lastDecision": "raise"}}
    assert engine_config(make_ctx(spec, status=was_tokens))["timeTarget"] == 0.8


def test_engine_config_copies_traffic_clusters_and_fills_defaults():
    spec = load_example("multi-cluster.yaml")["spec"]
    cfg = engine_config(make_ctx(spec))
    assert cfg["tokenBudget"] == 512
    assert [c["name"] for c in cfg["trafficClusters"]] == ["chat", "summarization", "batch"]
    chat = cfg["trafficClusters"][0]
    for key, value in spec["trafficClusters"][0].items():
        assert chat[key] == value  # copied unchanged
    summarization = cfg["trafficClusters"][1]
    # missing SLO field filled from spec.slo; explicit ones kept
    assert summarization["slo"] == {
        "ttftP99Seconds": 10.0,
        "tbtP99Seconds": 0.25,
        "schedulingDelayP50Seconds": 2.0,
    }
    no_clusters = engine_config(make_ctx({"model": {}, "admission": {"maxWaiting": 7}}))
    assert no_clusters["trafficClusters"] == [
        {
            "name": "default",
            "priority": 0,
            "slo": {"ttftP99Seconds": 2.0, "tbtP99Seconds": 0.2, "schedulingDelayP50Seconds": 2.0},
            "maxWaiting": 7,
        }
    ]


def test_controller_tuning_reaches_config_map_but_does_not_roll_pods():
    spec = load_example("multi-cluster.yaml")["spec"]
    status = {
        "budget": {"tokenBudget": 1024, "lastDecision": "raise"},
        "trafficClusters": [{"name": "chat", "chunkCap": 128, "maxWaiting": 16}],
    }
    plain, tuned = build_children(make_ctx(spec)), build_children(make_ctx(spec, status=status))
    cfg = yaml.safe_load(tuned[0]["data"]["engine.yaml"])
    assert cfg["tokenBudget"] == 1024
    assert cfg["trafficClusters"][0]["chunkCap"] == 128 and cfg["trafficClusters"][0]["maxWaiting"] == 16
    assert pod_template_hash(plain) == pod_template_hash(tuned)
    # a tuned budget outside [min, max] is clamped
    clamped = engine_config(
        make_ctx(spec, status={"budget": {"tokenBudget": 10**6, "lastDecision": "raise"}})
    )
    assert clamped["tokenBudget"] == 2048
    # the operator's own mirror of the budget (no controller decision yet) is not a tuned value
    assert engine_config(make_ctx(spec, status={"budget": {"tokenBudget": 64}}))["tokenBudget"] == 512


def test_spec_change_rolls_pods():
    spec = load_example("sarathideployment.yaml")["spec"]
    changed = {**spec, "budget": {**spec["budget"], "initial": 1024}}
    assert pod_template_hash(build_children(make_ctx(spec))) != pod_template_hash(
        build_children(make_ctx(changed))
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_child_is_owned_and_labelled(case: str):
    for child in build_children(CASES[case]()):
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["labels"]["serving.stallfree.dev/deployment"] == "demo"
        if child["kind"] == "PersistentVolumeClaim":
            continue  # the model cache: owned only when it goes with the deployment (see below)
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.stallfree.dev/v1alpha1",
                "kind": "SarathiDeployment",
                "name": "demo",
                "uid": OWNER.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["serving.stallfree.dev/deployment"] == "demo"


def test_gpu_requests_and_pod_layout():
    def pods(children):
        return [c for c in children if c["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")]

    one = pods(build_children(make_ctx({"model": {}, "parallelism": {"tensor": 4, "pipeline": 2}})))
    assert [c["kind"] for c in one] == ["Deployment"]
    res = one[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == "8" and res["limits"]["nvidia.com/gpu"] == "8"

    sts = pods(build_children(make_ctx(MULTI_NODE)))
    assert [c["metadata"]["name"] for c in sts] == ["demo-r0", "demo-r1"]
    assert all(s["spec"]["replicas"] == 2 for s in sts)  # 16 GPUs per replica over 8-GPU nodes
    env = {e["name"]: e for e in sts[1]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["STALLFREE_LEADER_ADDRESS"]["value"] == "demo-r1-0.demo-pods.serving.svc"
    assert env["STALLFREE_NUM_NODES"]["value"] == "2"

    lws = pods(build_children(make_ctx(MULTI_NODE, features=Features(leader_worker_set=True))))
    assert lws[0]["kind"] == "LeaderWorkerSet" and lws[0]["spec"]["leaderWorkerTemplate"]["size"] == 2

    cpu = pods(build_children(make_ctx({"model": {}, "resources": {"gpusPerPod": 0}})))
    assert (
        "nvidia.com/gpu" not in cpu[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    )


def test_pydantic_defaults_agree_with_the_crd():
    """An empty spec defaulted by the CRD and one defaulted by pydantic are the same spec."""
    from_crd = parse_spec(defaulted_spec({"model": {}}))
    from_pydantic = parse_spec({})
    assert from_crd == from_pydantic


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"budget": {"initial": 100, "min": 128, "max": 4096, "align": 32}}, "budget.initial"),
        ({"replicas": {"min": 3, "max": 1}}, "replicas.min"),
        ({"budget": {"chunkContextScale": 0}}, "budget.chunkContextScale"),
        ({"budget": {"timeTarget": 0}}, "budget.timeTarget"),
        ({"budget": {"timeTarget": 1.5}}, "budget.timeTarget"),
        ({"budget": {"mode": "seconds"}}, "budget.mode"),
        ({"budget": {"mode": "time"}, "engine": {"policy": "vllm"}}, "budget.mode time budgets sarathi"),
        ({"trafficClusters": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"model": {"source": {"type": "HostPath", "path": "rel"}}}, "model.source.path"),
    ],
)
def test_spec_model_repeats_the_crd_checks(spec: dict, message: str):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_spec(spec)
