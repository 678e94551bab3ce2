"""The real API server refuses bad SarathiDeployments, naming the field, and defaults good ones."""

from __future__ import annotations

import copy
import json

import pytest
from conftest_k8s import GROUP, PLURAL, VERSION, K8sEnv, load_example

pytestmark = pytest.mark.k8s

BASE = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "SarathiDeployment",
    "metadata": {"name": "bad"},
    "spec": {"model": {}},
}


def _with(path: str, value) -> dict:
    """BASE with spec.<path> set (dotted path; creates the objects on the way)."""
    obj = copy.deepcopy(BASE)
    node = obj
    *parents, last = ["spec", *path.split(".")] if path else ["spec"]
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return obj


def _spec(**spec) -> dict:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    return obj


def _cluster(**kw) -> dict:
    return {"name": "chat", **kw}


INVALID = [
    # (id, object, text the API server's message must contain)
    (
        "budget-initial-above-max",
        _spec(budget={"initial": 4096, "min": 128, "max": 2048}),
        "spec.budget.initial",
    ),
    (
        "budget-not-aligned",
        _spec(budget={"initial": 500, "min": 128, "max": 2048}),
        "multiples of budget.align",
    ),
    ("budget-min-above-max", _spec(budget={"initial": 512, "min": 1024, "max": 512}), "spec.budget.min"),
    (
        "budget-chunk-context-scale-zero",
        _spec(budget={"initial": 512, "min": 128, "max": 4096, "chunkContextScale": 0}),
        "spec.budget.chunkContextScale",
    ),
    ("budget-time-target-zero", _with("budget.timeTarget", 0), "spec.budget.timeTarget"),
    ("budget-time-target-above-one", _with("budget.timeTarget", 1.5), "spec.budget.timeTarget"),
    ("budget-mode-unknown", _with("budget.mode", "seconds"), "spec.budget.mode"),
    (
        "budget-time-mode-baseline-policy",
        _spec(budget={"mode": "time"}, engine={"policy": "vllm"}),
        "spec.budget.mode",
    ),
    ("replicas-min-above-max", _spec(replicas={"min": 3, "max": 2}), "spec.replicas.min"),
    (
        "replicas-desired-above-max",
        _spec(replicas={"min": 1, "max": 2, "desired": 5}),
        "spec.replicas.desired",
    ),
    (
        "gpus-per-pod-not-tp-x-pp",
        _spec(parallelism={"tensor": 2}, resources={"gpusPerPod": 1}),
        "spec.resources.gpusPerPod",
    ),
    (
        "tensor-wider-than-node",
        _spec(parallelism={"tensor": 16}, resources={"gpusPerNode": 8}),
        "spec.parallelism.tensor",
    ),
    (
        "span-not-multiple-of-node",
        _spec(parallelism={"tensor": 4, "pipeline": 3}, resources={"gpusPerNode": 8}),
        "spec.parallelism.pipeline",
    ),
    ("cpu-only-with-tp", _spec(parallelism={"tensor": 2}, resources={"gpusPerPod": 0}), "CPU only"),
    ("tbt-slo-zero", _with("slo", {"tbtP99Seconds": 0}), "tbtP99Seconds must be positive"),
    ("ttft-slo-negative", _with("slo", {"ttftP99Seconds": -1.0}), "ttftP99Seconds must be positive"),
    (
        "ttft-below-tbt",
        _with("slo", {"ttftP99Seconds": 0.1, "tbtP99Seconds": 0.5}),
        "spec.slo.ttftP99Seconds",
    ),
    ("cluster-names-duplicate", _spec(trafficClusters=[_cluster(), _cluster()]), "spec.trafficClusters"),
    (
        "cluster-name-not-dns-label",
        _spec(trafficClusters=[_cluster(name="Chat_1")]),
        "spec.trafficClusters[0].name",
    ),
    (
        "cluster-prompt-range-reversed",
        _spec(trafficClusters=[_cluster(match={"minPromptTokens": 100, "maxPromptTokens": 10})]),
        "spec.trafficClusters[0].match.minPromptTokens",
    ),
    (
        "cluster-slo-zero",
        _spec(trafficClusters=[_cluster(slo={"tbtP99Seconds": 0})]),
        "spec.trafficClusters[0].slo.tbtP99Seconds",
    ),
    (
        "chunk-cap-above-budget-max",
        _spec(trafficClusters=[_cluster(chunkCap=100000)]),
        "chunkCap must not exceed budget.max",
    ),
    (
        "cluster-max-running-above-max-num-seqs",
        _spec(engine={"maxNumSeqs": 8}, trafficClusters=[_cluster(maxRunning=64)]),
        "maxRunning must not exceed engine.maxNumSeqs",
    ),
    (
        "prompt-range-beyond-max-model-len",
        _spec(model={"maxModelLen": 1024}, trafficClusters=[_cluster(match={"maxPromptTokens": 4096})]),
        "maxPromptTokens must not exceed model.maxModelLen",
    ),
    ("policy-unknown", _with("engine.policy", "fifo"), "spec.engine.policy"),
    ("dtype-unknown", _with("model.dtype", "int8"), "spec.model.dtype"),
    ("block-size-odd", _with("engine.blockSize", 24), "spec.engine.blockSize"),
    ("prefix-caching-not-bool", _with("engine.prefixCaching", "yes"), "spec.engine.prefixCaching"),
    (
        "pvc-without-claim",
        _with("model.source", {"type": "PersistentVolumeClaim"}),
        "spec.model.source.claimName",
    ),
    (
        "hostpath-relative",
        _with("model.source", {"type": "HostPath", "path": "models/x"}),
        "spec.model.source.path",
    ),
    (
        "window-shorter-than-interval",
        _with("controller", {"intervalSeconds": 60, "windowSeconds": 30}),
        "spec.controller.windowSeconds",
    ),
    (
        "prometheus-url-not-http",
        _with("controller.prometheusUrl", "prometheus:9090"),
        "spec.controller.prometheusUrl",
    ),
    (
        "cost-model-without-const",
        _with("controller.costModel", {"prefillTokens": 0.002}),
        "spec.controller.costModel.const",
    ),
    (
        "cost-model-const-zero",
        _with("controller.costModel", {"const": 0}),
        "spec.controller.costModel.const",
    ),
    (
        "cost-model-negative-coefficient",
        _with("controller.costModel", {"const": 0.05, "decodeAttn": -1e-6}),
        "spec.controller.costModel.decodeAttn",
    ),
    (
        "cost-model-unknown-coefficient",
        _with("controller.costModel", {"const": 0.05, "prefill_tokens": 0.002}),
        'unknown field "spec.controller.costModel.prefill_tokens"',
    ),
    ("memory-not-quantity", _with("resources.memory", "lots"), "spec.resources.memory"),
    (
        "toleration-exists-with-value",
        _with("resources.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "x"}]),
        "spec.resources.tolerations[0]",
    ),
    (
        "admission-max-running-above-max-num-seqs",
        _spec(engine={"maxNumSeqs": 4}, admission={"maxRunning": 8}),
        "spec.admission.maxRunning",
    ),
    ("unknown-field", _spec(replica=3), 'unknown field "spec.replica"'),
    # HuggingFace sources and the model cache
    ("hf-without-uri", _with("model.source", {"type": "HuggingFace"}), "model.source.uri (hf://ORG/NAME"),
    (
        "hf-uri-not-hf",
        _with("model.source", {"type": "HuggingFace", "uri": "meta-llama/Llama-3.1-8B"}),
        "spec.model.source.uri",
    ),
    (
        "hf-uri-extra-path",
        _with("model.source", {"type": "HuggingFace", "uri": "hf://a/b/c"}),
        "spec.model.source.uri",
    ),
    (
        "hf-uri-dotdot",
        _with("model.source", {"type": "HuggingFace", "uri": "hf://a/b@x/../y"}),
        "must not contain '..'",
    ),
    (
        "uri-on-bundled",
        _with("model.source", {"type": "Bundled", "uri": "hf://a/b"}),
        "only for HuggingFace sources",
    ),
    (
        "hf-with-claim",
        _with("model.source", {"type": "HuggingFace", "uri": "hf://a/b", "claimName": "x"}),
        "only for PersistentVolumeClaim and HostPath",
    ),
    (
        "cache-on-claim-source",
        _with(
            "model",
            {"source": {"type": "PersistentVolumeClaim", "claimName": "m"}, "cache": {"size": "10Gi"}},
        ),
        "model.cache is only for",
    ),
    (
        "cache-class-without-size",
        _with(
            "model",
            {"source": {"type": "HuggingFace", "uri": "hf://a/b"}, "cache": {"storageClassName": "fast"}},
        ),
        "needs model.cache.size",
    ),
    (
        "cache-access-mode",
        _with(
            "model",
            {
                "source": {"type": "HuggingFace", "uri": "hf://a/b"},
                "cache": {"size": "1Gi", "accessMode": "ReadOnlyMany"},
            },
        ),
        "spec.model.cache.accessMode",
    ),
    (
        "token-secret-without-name",
        _with("model.source", {"type": "HuggingFace", "uri": "hf://a/b", "tokenSecret": {}}),
        "spec.model.source.tokenSecret.name",
    ),
    # pod pass-through
    ("pod-env-reserved", _with("pod.env", [{"name": "HF_TOKEN", "value": "x"}]), "pod.env must not set"),
    (
        "pod-env-value-and-from",
        _with("pod.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {}}}]),
        "value or valueFrom, not both",
    ),
    (
        "pod-envfrom-both",
        _with("pod.envFrom", [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]),
        "exactly one of configMapRef and secretRef",
    ),
    ("pod-volume-reserved", _with("pod.volumes", [{"name": "models", "emptyDir": {}}]), "must not be config"),
    (
        "pod-volume-two-sources",
        _with("pod.volumes", [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]),
        "exactly one volume source",
    ),
    (
        "pod-mount-unknown-volume",
        _with("pod", {"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}),
        "must name one of pod.volumes",
    ),
    (
        "pod-mount-reserved-path",
        _with(
            "pod",
            {
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "/models"}],
            },
        ),
        "must not be /etc/stallfree",
    ),
    (
        "pod-spread-bad-when",
        _with(
            "pod.topologySpreadConstraints",
            [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "Maybe"}],
        ),
        "spec.pod.topologySpreadConstraints[0].whenUnsatisfiable",
    ),
    ("pod-priority-class-name", _with("pod.priorityClassName", "Not A Name"), "spec.pod.priorityClassName"),
    ("gpu-memory-not-quantity", _with("resources.gpuMemory", "big"), "spec.resources.gpuMemory"),
    ("model-missing", {**BASE, "spec": {}}, "spec.model"),
]


@pytest.fixture(scope="module")
def custom_api(k8s: K8sEnv, crd: dict):
    from kubernetes import client

    return client.CustomObjectsApi(k8s.api_client())


def _create(custom_api, obj: dict, namespace: str = "default"):
    return custom_api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, obj, dry_run="All", field_validation="Strict"
    )


def test_at_least_fifteen_invalid_cases():
    assert len(INVALID) >= 15
    assert len({case[0] for case in INVALID}) == len(INVALID)


@pytest.mark.parametrize(("obj", "needle"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_api_server_refuses_invalid_spec(custom_api, obj: dict, needle: str):
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as err:
        _create(custom_api, obj)
    assert err.value.status in (400, 422), err.value.body  # 400: strict decoding of unknown fields
    message = json.loads(err.value.body)["message"]
    assert needle in message, message


def test_api_server_refuses_long_name(custom_api):
    from kubernetes.client.exceptions import ApiException

    obj = copy.deepcopy(BASE)
    obj["metadata"]["name"] = "a" * 51
    with pytest.raises(ApiException) as err:
        _create(custom_api, obj)
    assert (
        "metadata.name must be a DNS label of at most 50 characters" in json.loads(err.value.body)["message"]
    )


def test_api_server_fills_defaults(custom_api):
    created = _create(custom_api, copy.deepcopy(BASE))
    spec = created["spec"]
    assert spec["model"] == {"name": "SmolLM2-135M-Instruct", "dtype": "auto", "source": {"type": "Bundled"}}
    assert spec["parallelism"] == {"pipeline": 1}  # tensor unset: 1, or sized from a HuggingFace model
    assert "memory" not in spec["resources"]  # likewise: 8Gi, or sized
    assert spec["replicas"] == {"min": 1, "max": 1}
    # no initial: time mode (a spec that pins initial keeps tokens mode)
    assert spec["budget"] == {"min": 128, "max": 4096, "align": 32, "timeTarget": 0.8}
    assert spec["engine"]["policy"] == "sarathi" and spec["engine"]["port"] == 8000
    assert spec["engine"]["prefixCaching"] is True
    assert spec["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    assert spec["controller"] == {"enabled": True, "intervalSeconds": 15, "windowSeconds": 60}


@pytest.mark.parametrize(
    "budget",
    [{"mode": "time", "timeTarget": 1}, {"timeTarget": 0.05}, {"mode": "tokens"}, {"initial": 256}],
    ids=["time-target-one", "time-target-small", "tokens-without-initial", "initial-alone"],
)
def test_api_server_accepts_both_modes(custom_api, budget: dict):
    created = _create(custom_api, _with("budget", budget))
    assert created["spec"]["budget"]["timeTarget"] == budget.get("timeTarget", 0.8)
    assert ("initial" in created["spec"]["budget"]) == ("initial" in budget)  # never defaulted


def test_api_server_keeps_a_cost_model(custom_api):
    coeffs = {"const": 0.0588, "prefillTokens": 0.00257, "decodeTokens": 0.00441, "prefillAttn": 1.73e-06,
              "decodeAttn": 1.97e-05, "prefillChunks": 0.0146}  # fmt: skip
    created = _create(custom_api, _with("controller.costModel", coeffs))
    assert created["spec"]["controller"]["costModel"] == coeffs


@pytest.mark.parametrize("example", ["sarathideployment.yaml", "multi-cluster.yaml", "llama-3.1-8b-hf.yaml"])
def test_examples_are_valid(custom_api, example: str):
    obj = load_example(example)
    created = _create(custom_api, obj)
    assert created["metadata"]["name"] == obj["metadata"]["name"]
    for item in created["spec"].get("trafficClusters", []):
        assert "priority" in item  # item defaults applied
