"""Names, labels and owner references shared by every child manifest."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stallfree.operator.spec import API_VERSION, KIND, SarathiSpec

if TYPE_CHECKING:
    from stallfree.operator.model_source import SourceFacts
    from stallfree.operator.sizing import Sizing

MANAGED_BY = "stallfree-operator"
APP_NAME = "stallfree-engine"
LABEL_DEPLOYMENT = "serving.stallfree.dev/deployment"
LABEL_REPLICA = "serving.stallfree.dev/replica"
ANNOTATION_CONFIG_HASH = "serving.stallfree.dev/config-hash"
CONFIG_KEY = "engine.yaml"
COST_MODEL_KEY = "cost_model.json"  # time mode with spec.controller.costModel: the engine's --cost-model
CONFIG_DIR = "/etc/stallfree"
MODELS_DIR = "/models"


@dataclass(frozen=True, slots=True)
class Owner:
    """The SarathiDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


@dataclass(frozen=True, slots=True)
class Features:
    """Optional APIs found on the cluster."""

    service_monitor: bool = False  # monitoring.coreos.com/v1 ServiceMonitor (Prometheus Operator)
    leader_worker_set: bool = False  # leaderworkerset.x-k8s.io/v1 LeaderWorkerSet


@dataclass(frozen=True, slots=True)
class Tuned:
    """Values the budget controller chose (read from the CR status); None = not tuned yet."""

    token_budget: int | None = None
    time_target: float | None = None  # time mode
    replicas: int | None = None
    clusters: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # name -> {chunkCap, maxWaiting, maxRunning}

    @classmethod
    def from_status(cls, status: dict | None) -> Tuned:
        status = status or {}
        clusters: dict[str, dict[str, int]] = {}
        for item in status.get("trafficClusters") or []:
            knobs = {k: item[k] for k in ("chunkCap", "maxWaiting", "maxRunning") if item.get(k) is not None}
            if knobs and item.get("name"):
                clusters[item["name"]] = knobs
        budget = status.get("budget") or {}
        decided = bool(budget.get("lastDecision"))
        mode = budget.get("mode")  # the mode they were tuned in: a value of the other mode is not a tuning
        return cls(
            # The operator mirrors the budget in force into status.budget.tokenBudget (and timeTarget); it
            # is the controller's choice only once the controller has recorded a decision.
            token_budget=budget.get("tokenBudget") if decided and mode != "time" else None,
            time_target=budget.get("timeTarget") if decided and mode != "tokens" else None,
            replicas=status.get("desiredReplicas"),
            clusters=clusters,
        )


@dataclass(frozen=True, slots=True)
class BuildContext:
    """Everything the builders need, gathered once per reconcile."""

    owner: Owner
    spec: SarathiSpec
    raw_spec: dict  # the CR's spec as stored (traffic clusters are copied from it verbatim)
    engine_image: str  # spec.engine.image or the operator's default
    tuned: Tuned = Tuned()
    features: Features = Features()
    hub_endpoint: str | None = None  # the operator's --hf-endpoint (a spec's model.source.endpoint wins)
    model: SourceFacts | None = None  # a HuggingFace source as read from the hub (None for other sources)
    sizing: Sizing | None = None  # what was derived from it; already applied to `spec`

    @property
    def replicas(self) -> int:
        return self.spec.replica_count(self.tuned.replicas)


def selector_labels(owner: Owner) -> dict[str, str]:
    """Labels that select this deployment's engine pods (never change them: selectors are immutable)."""
    return {"app.kubernetes.io/name": APP_NAME, LABEL_DEPLOYMENT: owner.name}


def labels(owner: Owner, component: str = "engine") -> dict[str, str]:
    return {
        **selector_labels(owner),
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(owner).items())


def owner_reference(owner: Owner) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(owner: Owner, name: str, component: str = "engine", **extra: dict) -> dict:
    """Child metadata: namespace, labels, and the owner reference that makes deletion cascade."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [owner_reference(owner)],
        **extra,
    }


def content_hash(obj: object) -> str:
    """A short stable hash of JSON-able data (pod template annotations use it to roll pods)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# ---- child names ----------------------------------------------------------------------------------
def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-engine"


def admin_secret_name(owner: Owner) -> str:
    return f"{owner.name}-admin"


def headless_service_name(owner: Owner) -> str:
    return f"{owner.name}-pods"


def replica_group_name(owner: Owner, index: int) -> str:
    return f"{owner.name}-r{index}"
