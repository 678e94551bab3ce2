"""Engine pods: the pod template and the workload that runs it.

One replica on one node -> a Deployment. One replica spanning nodes (tensor x pipeline > gpusPerNode) -> a
LeaderWorkerSet when that API exists, else one StatefulSet per replica behind a headless Service, with rank
environment variables.
"""

from __future__ import annotations

import copy

from stallfree.operator.builders.config import (
    cost_model_document,
    engine_config,
    time_target,
    token_budget,
)
from stallfree.operator.builders.meta import (
    ANNOTATION_CONFIG_HASH,
    CONFIG_DIR,
    CONFIG_KEY,
    COST_MODEL_KEY,
    LABEL_REPLICA,
    MODELS_DIR,
    BuildContext,
    admin_secret_name,
    config_map_name,
    content_hash,
    headless_service_name,
    labels,
    metadata,
    replica_group_name,
    selector_labels,
)
from stallfree.operator.builders.model import download_init_container, engine_model_arg, model_volume

ENGINE_CONTAINER = "engine"
ENGINE_UID = 1000
DIST_PORT = 29500  # torch.distributed rendezvous between the pods of one replica
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
STS_POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def budget_args(ctx: BuildContext, cost_model_path: str | None = None) -> list[str]:
    """How `stallfree serve` budgets iterations. Tokens mode: --token-budget alone (the paper's fixed
    budget, which the controller retunes). Time mode: --token-budget as the cap with --time-target, and
    `cost_model_path` as --cost-model (the calibration's prior) when given."""
    args = ["--token-budget", str(token_budget(ctx, tuned=False))]
    target = time_target(ctx, tuned=False)
    if target is not None:
        args += ["--time-target", f"{target:g}"]
        if cost_model_path is not None:
            args += ["--cost-model", cost_model_path]
    return args


def engine_args(ctx: BuildContext) -> list[str]:
    """Arguments of `stallfree serve` (the engine's CLI contract)."""
    s = ctx.spec
    max_len = ["--max-model-len", str(s.model.max_model_len)] if s.model.max_model_len else []
    scale = s.budget.chunk_context_scale
    charge = ["--chunk-context-scale", str(scale)] if scale is not None else []
    prior = f"{CONFIG_DIR}/{COST_MODEL_KEY}" if cost_model_document(ctx) is not None else None
    return [
        "--model", engine_model_arg(ctx),
        "--served-model-name", s.model.name,
        *max_len,
        "--host", "0.0.0.0",
        "--port", str(s.engine.port),
        "--policy", s.engine.policy,
        *budget_args(ctx, prior),
        *charge,
        "--max-num-seqs", str(s.engine.max_num_seqs),
        "--block-size", str(s.engine.block_size),
        "--dtype", s.model.dtype,
        "--traffic-clusters", f"{CONFIG_DIR}/{CONFIG_KEY}",
        "--tensor-parallel-size", str(s.parallelism.tensor),
        "--pipeline-parallel-size", str(s.parallelism.pipeline),
        "--enable-prefix-caching" if s.engine.prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip


def _env(ctx: BuildContext) -> list[dict]:
    admin = ctx.spec.engine.admin_token_secret
    admin_ref = (
        {"name": admin.name, "key": admin.key}
        if admin
        else {"name": admin_secret_name(ctx.owner), "key": "token"}
    )
    env = [
        {"name": "STALLFREE_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": admin_ref}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    api_key = ctx.spec.engine.api_key_secret
    if api_key:
        env.append(
            {
                "name": "STALLFREE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": api_key.name, "key": api_key.key}},
            }
        )
    return env + copy.deepcopy(list(ctx.spec.pod.env))


def _resources(ctx: BuildContext) -> dict:
    r = ctx.spec.resources
    requests = {"cpu": str(r.cpu), "memory": str(r.memory)}
    limits = {"memory": str(r.memory)}  # no CPU limit: throttling an engine's step loop only adds latency
    gpus = ctx.spec.gpus_per_pod
    if gpus:
        requests[r.gpu_resource_name] = str(gpus)
        limits[r.gpu_resource_name] = str(gpus)  # extended resources need limit == request
    return {"requests": requests, "limits": limits}


def _volumes(ctx: BuildContext) -> tuple[list[dict], list[dict]]:
    volumes = [
        {"name": "config", "configMap": {"name": config_map_name(ctx.owner)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(ctx.spec.resources.shm_size)}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    models = model_volume(ctx)
    if models is not None:
        volumes.append(models)
        mounts.append({"name": models["name"], "mountPath": MODELS_DIR, "readOnly": True})
    pod = ctx.spec.pod
    return volumes + copy.deepcopy(list(pod.volumes)), mounts + copy.deepcopy(list(pod.volume_mounts))


def _probe(path: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def engine_container(ctx: BuildContext, extra_env: list[dict] | None = None) -> dict:
    volumes_mounts = _volumes(ctx)[1]
    container = {
        "name": ENGINE_CONTAINER,
        "image": ctx.engine_image,
        "imagePullPolicy": ctx.spec.engine.image_pull_policy,
        "command": ["stallfree", "serve"],
        "args": engine_args(ctx),
        "ports": [{"name": "http", "containerPort": ctx.spec.engine.port, "protocol": "TCP"}],
        "env": _env(ctx) + (extra_env or []),
        "resources": _resources(ctx),
        "volumeMounts": volumes_mounts,
        # Loading weights can take minutes: the startup probe holds liveness off for up to 20 of them.
        "startupProbe": _probe("/health", 5, 240),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "securityContext": container_security_context(),
    }
    if ctx.spec.pod.env_from:
        container["envFrom"] = copy.deepcopy(list(ctx.spec.pod.env_from))
    return container


def pod_template(
    ctx: BuildContext, extra_labels: dict | None = None, extra_env: list[dict] | None = None
) -> dict:
    """The engine pod. Its config-hash annotation covers the spec-derived engine config only, so a spec
    change rolls the pods while the budget controller's run-time tuning (admin API) does not."""
    spec = ctx.spec
    pod: dict = {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.drain_seconds,  # SIGTERM = drain, then exit
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [engine_container(ctx, extra_env)],
        "volumes": _volumes(ctx)[0],
    }
    if spec.resources.node_selector:
        pod["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.resources.tolerations
        ]
    init = download_init_container(ctx, container_security_context())
    if init is not None:
        pod["initContainers"] = [init]
    _pass_through(ctx, pod)
    return {
        "metadata": {
            "labels": {**labels(ctx.owner), **(extra_labels or {})},
            "annotations": {
                ANNOTATION_CONFIG_HASH: _config_hash(ctx),
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(spec.engine.port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod,
    }


def _config_hash(ctx: BuildContext) -> str:
    """What the engines read at start (the spec's engine.yaml, and the cost-model prior when there is one):
    a change to it rolls the pods; the controller's run-time tuning does not."""
    doc = engine_config(ctx, tuned=False)
    prior = cost_model_document(ctx)
    return content_hash(doc if prior is None else {**doc, COST_MODEL_KEY: prior})


def _pass_through(ctx: BuildContext, pod: dict) -> None:
    """spec.pod's pod-level fields, as written."""
    p = ctx.spec.pod
    if p.image_pull_secrets:
        pod["imagePullSecrets"] = copy.deepcopy(list(p.image_pull_secrets))
    if p.priority_class_name:
        pod["priorityClassName"] = p.priority_class_name
    if p.affinity:
        pod["affinity"] = copy.deepcopy(p.affinity)
    if p.topology_spread_constraints:
        pod["topologySpreadConstraints"] = copy.deepcopy(list(p.topology_spread_constraints))


def build_deployment(ctx: BuildContext) -> dict:
    """One pod per replica. Rolling updates surge one pod and never drop below the desired count, so a
    spec change keeps serving (it waits for a free GPU slot instead of taking one away)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx.owner, ctx.owner.name),
        "spec": {
            "replicas": ctx.replicas,
            "selector": {"matchLabels": selector_labels(ctx.owner)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": pod_template(ctx),
        },
    }


def _group_env(ctx: BuildContext, rank_label: str, leader: str) -> list[dict]:
    return [
        {"name": "STALLFREE_NUM_NODES", "value": str(ctx.spec.pods_per_replica)},
        {
            "name": "STALLFREE_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{rank_label}']"}},
        },
        {"name": "STALLFREE_LEADER_ADDRESS", "value": leader},
        {"name": "MASTER_ADDR", "value": leader},
        {"name": "MASTER_PORT", "value": str(DIST_PORT)},
    ]


def build_replica_group_statefulsets(ctx: BuildContext) -> list[dict]:
    """One StatefulSet per replica: pod i of it is node rank i, pod 0 leads and serves HTTP."""
    owner, headless = ctx.owner, headless_service_name(ctx.owner)
    out = []
    for index in range(ctx.replicas):
        name = replica_group_name(owner, index)
        leader = f"{name}-0.{headless}.{owner.namespace}.svc"
        group = {LABEL_REPLICA: str(index)}
        template = pod_template(ctx, group, _group_env(ctx, STS_POD_INDEX_LABEL, leader))
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": _sts_meta(ctx, name, group),
                "spec": {
                    "replicas": ctx.spec.pods_per_replica,
                    "serviceName": headless,
                    "podManagementPolicy": "Parallel",  # ranks start together; rendezvous waits for all
                    "selector": {"matchLabels": {**selector_labels(owner), **group}},
                    "updateStrategy": {"type": "RollingUpdate"},
                    "template": template,
                },
            }
        )
    return out


def _sts_meta(ctx: BuildContext, name: str, group: dict) -> dict:
    meta = metadata(ctx.owner, name)
    meta["labels"] = {**meta["labels"], **group}
    return meta


def build_leader_worker_set(ctx: BuildContext) -> dict:
    """LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): one group of pods_per_replica pods per replica;
    LWS injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX as well."""
    owner = ctx.owner
    leader = "$(LWS_LEADER_ADDRESS)"  # set by LWS on every pod of the group
    template = pod_template(ctx, None, _group_env(ctx, LWS_WORKER_INDEX_LABEL, leader))
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "replicas": ctx.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "leaderWorkerTemplate": {
                "size": ctx.spec.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }


def build_workloads(ctx: BuildContext) -> list[dict]:
    if not ctx.spec.multi_node:
        return [build_deployment(ctx)]
    if ctx.features.leader_worker_set:
        return [build_leader_worker_set(ctx)]
    return build_replica_group_statefulsets(ctx)
