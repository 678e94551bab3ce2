"""HuggingFace model sources on the real control plane, with the operator reading a real HTTP server that
speaks the hub's file API: the init container, cache claim, sizing and secret references it builds; bad
sources reported in ModelReady; the cache claim kept or deleted with the SarathiDeployment as the spec says."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest_k8s import K8sEnv, OperatorProcess, wait_until
from fake_hub import FakeHub

pytestmark = pytest.mark.k8s
TOKEN = "hf_cluster_token"
# Llama-3.1-70B's config.json; the listing reports 141 GB of safetensors (the bytes themselves are tiny).
CONFIG_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
              "torch_dtype": "bfloat16"}  # fmt: skip


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    files = {"config.json": json.dumps(CONFIG_70B).encode(), "model.safetensors": b"\0" * 64}
    fake.add_repo("acme/llama-70b", files, token=TOKEN, sizes={"model.safetensors": 141_107_412_992})
    fake.add_repo("acme/open-model", files)
    fake.start()
    yield fake
    fake.stop()


def cr(name: str, source: dict, **model) -> dict:
    return {
        "apiVersion": "serving.stallfree.dev/v1alpha1",
        "kind": "SarathiDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": f"acme/{name}", "source": {"type": "HuggingFace", **source}, **model}},
    }


def condition(k8s: K8sEnv, ns: str, name: str, ctype: str) -> dict:
    obj = k8s.get("sarathideployment", name, ns) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def test_hf_source_gets_download_init_container_cache_claim_and_sizing(
    k8s: K8sEnv, operator_all: OperatorProcess, namespace: str, hub: FakeHub
):
    k8s.kubectl("create", "secret", "generic", "hf", f"--from-literal=hf-token={TOKEN}", "-n", namespace)
    source = {
        "uri": "hf://acme/llama-70b@main",
        "endpoint": hub.url,
        "tokenSecret": {"name": "hf", "key": "hf-token"},
    }
    body = cr("big", source, cache={"size": "200Gi", "retainOnDelete": False}, maxModelLen=8192)
    k8s.apply(body, namespace)

    def sized():
        obj = k8s.get("sarathideployment", "big", namespace) or {}
        return (obj.get("status") or {}).get("model")

    model = wait_until(sized, timeout=120, what="status.model")
    assert model["size"] == "131.4Gi" and model["weightBytes"] == 141_107_412_992
    assert model["gpusPerReplica"] == 2 and model["memory"] == "10Gi"  # 80Gi GPUs; streaming loader
    assert (
        model["kvBytesPerToken"] == 2 * 80 * 8 * 128 * 2
        and model["commit"] == hub.repos["acme/llama-70b"].commit
    )
    table = k8s.kubectl("get", "sarathi", "big", "-n", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert row[header.index("SIZE")] == "131.4Gi" and row[header.index("TP")] == "2"  # sized, from status

    dep = wait_until(lambda: k8s.get("deployment", "big", namespace), timeout=30, what="Deployment")
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["stallfree", "download"]
    assert init["args"][:3] == ["hf://acme/llama-70b@main", "--download-dir", "/models"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "hf-token"}
    assert env["HF_ENDPOINT"]["value"] == hub.url
    engine = pod["containers"][0]
    flags = engine["args"][:-1]  # the last one, --enable-prefix-caching, takes no value
    args = dict(zip(flags[::2], flags[1::2], strict=True))
    assert args["--model"] == "/models/acme/llama-70b/main" and args["--served-model-name"] == "acme/big"
    assert args["--tensor-parallel-size"] == "2" and args["--max-model-len"] == "8192"
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert engine["resources"]["limits"]["memory"] == "10Gi"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "big-model-cache"}

    claim = k8s.get("pvc", "big-model-cache", namespace)
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert [r["name"] for r in claim["metadata"]["ownerReferences"]] == ["big"]

    # The spec's values override the sizing.
    k8s.kubectl("patch", "sarathideployment", "big", "-n", namespace, "--type=merge",
                "-p", json.dumps({"spec": {"parallelism": {"tensor": 4}, "resources": {"memory": "32Gi"}}}))  # fmt: skip

    def overridden():
        c = (k8s.get("deployment", "big", namespace) or {})["spec"]["template"]["spec"]["containers"][0]
        return (
            c["resources"]["limits"]["memory"] == "32Gi"
            and "4" == c["resources"]["requests"]["nvidia.com/gpu"]
        )

    wait_until(overridden, timeout=30, what="spec values over the sizing")

    k8s.kubectl("delete", "sarathideployment", "big", "-n", namespace, "--wait=true", timeout=60)
    wait_until(lambda: k8s.get("pvc", "big-model-cache", namespace) is None, timeout=60,
               what="the cache claim deleted with its SarathiDeployment (retainOnDelete: false)")  # fmt: skip


def test_retained_cache_claim_outlives_the_deployment(
    k8s: K8sEnv, operator_all: OperatorProcess, namespace: str, hub: FakeHub
):
    k8s.apply(
        cr("keep", {"uri": "hf://acme/open-model", "endpoint": hub.url}, cache={"size": "1Gi"}), namespace
    )
    claim = wait_until(lambda: k8s.get("pvc", "keep-model-cache", namespace), timeout=60, what="cache claim")
    assert not claim["metadata"].get("ownerReferences")  # retainOnDelete defaults to true
    k8s.kubectl("delete", "sarathideployment", "keep", "-n", namespace, "--wait=true", timeout=60)
    wait_until(
        lambda: k8s.get("deployment", "keep", namespace) is None, timeout=60, what="children collected"
    )
    assert k8s.get("pvc", "keep-model-cache", namespace) is not None
    # A new deployment of the same name picks the same claim up (the weights are already there).
    k8s.apply(
        cr("keep", {"uri": "hf://acme/open-model", "endpoint": hub.url}, cache={"size": "1Gi"}), namespace
    )
    dep = wait_until(lambda: k8s.get("deployment", "keep", namespace), timeout=60, what="Deployment again")
    claims = [v.get("persistentVolumeClaim") for v in dep["spec"]["template"]["spec"]["volumes"]]
    assert {"claimName": "keep-model-cache"} in claims
    assert k8s.get("pvc", "keep-model-cache", namespace)["metadata"]["uid"] == claim["metadata"]["uid"]


@pytest.mark.parametrize(
    ("name", "source", "reason"),
    [
        ("missing", {"uri": "hf://acme/no-such-model"}, "RepoNotFound"),
        ("gated", {"uri": "hf://acme/llama-70b"}, "GatedRepo"),
        ("no-branch", {"uri": "hf://acme/open-model@no-such-branch"}, "RevisionNotFound"),
        (
            "no-secret",
            {"uri": "hf://acme/llama-70b", "tokenSecret": {"name": "absent"}},
            "TokenSecretNotFound",
        ),
    ],
)
def test_bad_sources_are_reported_in_conditions(
    k8s: K8sEnv,
    operator_all: OperatorProcess,
    namespace: str,
    hub: FakeHub,
    name: str,
    source: dict,
    reason: str,
):
    k8s.apply(cr(name, {**source, "endpoint": hub.url}), namespace)
    cond = wait_until(lambda: condition(k8s, namespace, name, "ModelReady").get("reason") == reason
                      and condition(k8s, namespace, name, "ModelReady"), timeout=60, what=f"ModelReady {reason}")  # fmt: skip
    assert cond["status"] == "False" and cond["message"]
    degraded = condition(k8s, namespace, name, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", reason)
    assert (k8s.get("sarathideployment", name, namespace)["status"]["phase"]) == "Degraded"


def test_pod_fields_the_api_server_refuses_are_reported(
    k8s: K8sEnv, operator_all: OperatorProcess, namespace: str
):
    """The CRD checks pass-through fields' shape only down to the Kubernetes types it does not copy (an
    affinity's insides): what the API server then refuses in the Deployment lands on the resource."""
    terms = [{"matchExpressions": [{"key": "gpu", "operator": "Maybe"}]}]  # no such operator
    bad = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    body = {
        "apiVersion": "serving.stallfree.dev/v1alpha1",
        "kind": "SarathiDeployment",
        "metadata": {"name": "odd-pod"},
        "spec": {"model": {}, "pod": {"affinity": bad}},
    }
    k8s.apply(body, namespace)
    cond = wait_until(lambda: condition(k8s, namespace, "odd-pod", "Degraded").get("reason") == "InvalidSpec"
                      and condition(k8s, namespace, "odd-pod", "Degraded"), timeout=60, what="Degraded InvalidSpec")  # fmt: skip
    assert "the API server refused a child" in cond["message"] and "Maybe" in cond["message"]
    assert k8s.get("deployment", "odd-pod", namespace) is None
