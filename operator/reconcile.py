"""Reconciliation: apply a SarathiDeployment's children and work out its status.

Synchronous and free of kopf, so it can be driven by the kopf handlers (in kopf's thread pool), by tests,
and later by the budget controller (stallfree.operator.controller) without an event loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

from stallfree.operator import builders
from stallfree.operator.builders.meta import (
    LABEL_DEPLOYMENT,
    MANAGED_BY,
    BuildContext,
    Features,
    Owner,
    Tuned,
    admin_secret_name,
    selector_string,
)
from stallfree.operator.kube import Kube
from stallfree.operator.model_source import ModelSourceReader, SourceFacts
from stallfree.operator.model_status import model_condition, model_status
from stallfree.operator.sizing import Sizing, size
from stallfree.operator.spec import SarathiSpec, parse_spec
from stallfree.operator.status import Observed, status_patch

log = logging.getLogger(__name__)

Recorder = Callable[[str, str], None]  # (reason, message): one change made to a child

DEFAULT_ENGINE_IMAGE = "stallfree/engine:0.1.0"
FAILING_REASONS = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "InvalidImageName",
}
# Kinds the operator may have created, for pruning what the current spec no longer wants.
PRUNABLE = (
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("v1", "Service"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
)


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Operator settings, read once at start-up (CLI flags) and passed down."""

    engine_image: str = DEFAULT_ENGINE_IMAGE
    prometheus_url: str | None = None
    resync_seconds: float = 30.0  # drift-correcting timer period
    features_ttl_seconds: float = 60.0  # how long a look at optional APIs (ServiceMonitor, LWS) is trusted
    hub_endpoint: str | None = None  # HF_ENDPOINT for HuggingFace sources that set no model.source.endpoint
    hub_timeout_seconds: float = 10.0  # per hub call when reading a model's config at reconcile


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube = kube
        self.config = config
        self._features: tuple[float, Features] | None = None
        self.model_sources = ModelSourceReader(kube, config.hub_endpoint, timeout=config.hub_timeout_seconds)

    # ---- inputs -------------------------------------------------------------------------------------
    def features(self) -> Features:
        now = time.monotonic()
        if self._features is None or now - self._features[0] > self.config.features_ttl_seconds:
            found = Features(
                service_monitor=self.kube.has_api("monitoring.coreos.com/v1", "ServiceMonitor"),
                leader_worker_set=self.kube.has_api("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
            )
            self._features = (now, found)
        return self._features[1]

    def context(self, body: dict, spec: SarathiSpec | None = None) -> BuildContext:
        spec = spec or parse_spec(body.get("spec") or {})
        raw_spec = dict(body.get("spec") or {})
        facts = None
        if spec.model.source.type == "HuggingFace":
            namespace = body["metadata"]["namespace"]
            facts = self.model_sources.read(namespace, spec.model.source, body.get("status"))
        spec, sizing = sized_spec(spec, raw_spec, facts)
        return BuildContext(
            owner=Owner.from_body(body),
            spec=spec,
            raw_spec=raw_spec,
            engine_image=spec.engine.image or self.config.engine_image,
            tuned=Tuned.from_status(body.get("status")),
            features=self.features(),
            hub_endpoint=self.config.hub_endpoint,
            model=facts,
            sizing=sizing,
        )

    # ---- writes -------------------------------------------------------------------------------------
    def apply_children(self, ctx: BuildContext, record: Recorder) -> list[str]:
        """Create or patch every child; delete the ones the spec no longer wants. Returns what changed
        ("created Deployment x", ...) and passes each change to `record(reason, message)` (the kopf
        handlers turn them into Kubernetes Events on the SarathiDeployment)."""
        changes: list[str] = []
        if ctx.spec.engine.admin_token_secret is None:
            name = admin_secret_name(ctx.owner)
            if self.kube.get("v1", "Secret", ctx.owner.namespace, name) is None:
                try:
                    self.kube.create(builders.build_admin_secret(ctx.owner, secrets.token_urlsafe(32)))
                    changes.append(f"created Secret {name}")
                except ApiException as e:
                    if e.status != 409:  # 409: a concurrent reconcile (timer vs. handler) made it first
                        raise
        wanted: set[tuple[str, str]] = set()
        for manifest in builders.build_children(ctx):
            applied = self.kube.apply(manifest)
            wanted.add((manifest["kind"], manifest["metadata"]["name"]))
            if applied.action != "unchanged":
                changes.append(f"{applied.action} {manifest['kind']} {manifest['metadata']['name']}")
        changes += self._prune(ctx, wanted)
        for change in changes:
            record(change.split(" ", 1)[0].capitalize(), change)
        return changes

    def _prune(self, ctx: BuildContext, wanted: set[tuple[str, str]]) -> list[str]:
        feats = ctx.features
        selector = f"{LABEL_DEPLOYMENT}={ctx.owner.name},app.kubernetes.io/managed-by={MANAGED_BY}"
        deleted = []
        for api_version, kind in PRUNABLE:
            if (kind == "LeaderWorkerSet" and not feats.leader_worker_set) or (
                kind == "ServiceMonitor" and not feats.service_monitor
            ):
                continue
            for obj in self.kube.list(api_version, kind, ctx.owner.namespace, selector):
                meta = obj["metadata"]
                owned = any(ref.get("uid") == ctx.owner.uid for ref in meta.get("ownerReferences") or [])
                if owned and (kind, meta["name"]) not in wanted:
                    if self.kube.delete(api_version, kind, ctx.owner.namespace, meta["name"]):
                        deleted.append(f"deleted {kind} {meta['name']}")
        return deleted

    # ---- reads --------------------------------------------------------------------------------------
    def observe(self, ctx: BuildContext, generation: int) -> Observed:
        ns, owner, spec = ctx.owner.namespace, ctx.owner, ctx.spec
        desired = ctx.replicas
        counts = self._workload_counts(ctx)
        pods = self.kube.list("v1", "Pod", ns, selector_string(owner))
        unschedulable, failing = _pod_problems(pods)
        port = spec.engine.port
        extra = {
            "selector": selector_string(owner),
            "endpoint": f"http://{owner.name}.{ns}.svc:{port}/v1",
            "tensorParallel": spec.parallelism.tensor,  # the TP column: sized values show too
        }
        model = model_status(ctx)
        if model is not None:
            extra["model"] = model
        return Observed(
            generation=generation,
            desired=desired,
            unschedulable=unschedulable,
            failing=failing,
            model_ready=model_condition(ctx, pods, generation),
            extra=extra,
            **counts,
        )

    def _workload_counts(self, ctx: BuildContext) -> dict:
        ns, owner, spec = ctx.owner.namespace, ctx.owner, ctx.spec
        if not spec.multi_node:
            dep = self.kube.get("apps/v1", "Deployment", ns, owner.name) or {}
            st, meta = dep.get("status") or {}, dep.get("metadata") or {}
            deadline = next(
                (
                    c.get("message")
                    for c in st.get("conditions") or []
                    if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                ),
                None,
            )
            return {
                "replicas": st.get("replicas", 0),
                "ready": st.get("readyReplicas", 0),
                "updated": st.get("updatedReplicas", 0),
                "workloads_current": bool(dep)
                and st.get("observedGeneration", 0) >= meta.get("generation", 1),
                "deadline_exceeded": deadline,
            }
        if ctx.features.leader_worker_set:
            lws = self.kube.get("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", ns, owner.name) or {}
            st = lws.get("status") or {}
            return {
                "replicas": st.get("replicas", 0),
                "ready": st.get("readyReplicas", 0),
                "updated": st.get("updatedReplicas", 0),
                "workloads_current": bool(lws),
            }
        sets = self.kube.list("apps/v1", "StatefulSet", ns, selector_string(owner))
        size = spec.pods_per_replica
        ready = updated = 0
        current = len(sets) == ctx.replicas
        for sts in sets:
            st = sts.get("status") or {}
            ready += st.get("readyReplicas", 0) >= size
            updated += st.get("updatedReplicas", 0) >= size and st.get("currentRevision") == st.get(
                "updateRevision"
            )
            current = current and st.get("observedGeneration", 0) >= sts["metadata"].get("generation", 1)
        return {"replicas": len(sets), "ready": ready, "updated": updated, "workloads_current": current}

    # ---- the whole loop -----------------------------------------------------------------------------
    def reconcile(self, body: dict, record: Recorder) -> dict:
        """Apply the children of `body` and return the status fields to write (may equal the current)."""
        ctx = self.context(body)
        self.apply_children(ctx, record)
        return self.status(ctx, body)

    def status(self, ctx: BuildContext, body: dict) -> dict:
        observed = self.observe(ctx, body["metadata"].get("generation", 1))
        cfg = builders.engine_config(ctx)
        return status_patch(observed, body.get("status"), cfg["tokenBudget"], cfg.get("timeTarget"))


def sized_spec(
    spec: SarathiSpec, raw_spec: dict, facts: SourceFacts | None
) -> tuple[SarathiSpec, Sizing | None]:
    """The spec with the sized GPU count and memory filled in where the CR leaves them unset (see
    stallfree.operator.sizing); unchanged without a model shape."""
    if facts is None or facts.shape is None:
        return spec, None
    raw_par, raw_res = raw_spec.get("parallelism") or {}, raw_spec.get("resources") or {}
    r, p = spec.resources, spec.parallelism
    sizing = size(
        facts.shape,
        dtype=spec.model.dtype,
        max_model_len=spec.model.max_model_len,
        max_num_seqs=spec.engine.max_num_seqs,
        gpu_memory=r.gpu_memory,
        gpus_per_node=r.gpus_per_node,
        cpu_only=spec.gpus_per_pod == 0,
        size_gpus="tensor" not in raw_par and "gpusPerPod" not in raw_res,
        size_memory="memory" not in raw_res,
        fixed_gpus=spec.gpus_per_pod,
        pipeline=p.pipeline,
    )
    update: dict = {}
    if sizing.gpus is not None and sizing.gpus != p.tensor:
        update["parallelism"] = p.model_copy(update={"tensor": sizing.gpus})
    if sizing.memory is not None:
        update["resources"] = r.model_copy(update={"memory": sizing.memory})
    return (spec.model_copy(update=update) if update else spec), sizing


def _pod_problems(pods: list[dict]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    unschedulable, failing = [], []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        st = pod.get("status") or {}
        for c in st.get("conditions") or []:
            if (
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"
            ):
                unschedulable.append(f"pod {pod['metadata']['name']}: {c.get('message', 'Unschedulable')}")
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in FAILING_REASONS:
                failing.append(
                    f"pod {pod['metadata']['name']}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(
                        ": "
                    )
                )
    return tuple(unschedulable), tuple(failing)
