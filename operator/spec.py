"""The SarathiDeployment spec as pydantic models: the operator's trust boundary.

The API server already defaulted and validated the object against crds/sarathideployment.yaml; these models
mirror that schema (same names, same defaults, tests/operator/test_spec.py checks the defaults agree) so the
builders get typed values, and repeat the cross-field checks so a spec that reaches us some other way (local
mode, an old CRD) fails with the same message instead of a half-built fleet.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stallfree.engine.hub import HubRef, parse_hub_uri
from stallfree.slo import Slo

GROUP = "serving.stallfree.dev"
VERSION = "v1alpha1"
KIND = "SarathiDeployment"
PLURAL = "sarathideployments"
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_INITIAL_TOKENS = 512  # tokens mode without budget.initial


class _Model(BaseModel):
    # Unknown fields are refused: the CRD prunes them, so one here means a schema drift worth knowing about.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class SecretKey(_Model):
    name: str
    key: str


class HubTokenSecret(SecretKey):
    key: str = "token"


class ModelSource(_Model):
    type: Literal["Bundled", "PersistentVolumeClaim", "HostPath", "HuggingFace"] = "Bundled"
    claim_name: str | None = Field(None, alias="claimName")
    path: str | None = None
    uri: str | None = None  # hf://ORG/NAME[@REVISION]
    token_secret: HubTokenSecret | None = Field(None, alias="tokenSecret")
    endpoint: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSource:
        if self.type == "PersistentVolumeClaim" and not self.claim_name:
            raise ValueError(
                "model.source.claimName is required when model.source.type is PersistentVolumeClaim"
            )
        if self.type == "HostPath" and not (self.path or "").startswith("/"):
            raise ValueError("model.source.path must be an absolute path when model.source.type is HostPath")
        if self.type == "HuggingFace":
            if not self.uri:
                raise ValueError(
                    "model.source.uri (hf://ORG/NAME[@REVISION]) is required when model.source.type is HuggingFace"
                )
            parse_hub_uri(self.uri)  # ValueError naming the expected form
        elif self.uri or self.token_secret or self.endpoint:
            raise ValueError("model.source.uri, tokenSecret and endpoint are only for HuggingFace sources")
        return self

    @property
    def hub_ref(self) -> HubRef | None:
        return parse_hub_uri(self.uri) if self.type == "HuggingFace" and self.uri else None


class ModelCache(_Model):
    """Where a HuggingFace source is downloaded: a claim when size is set, else an emptyDir per pod."""

    size: str | int | None = None
    storage_class_name: str | None = Field(None, alias="storageClassName")
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = Field("ReadWriteOnce", alias="accessMode")
    retain_on_delete: bool = Field(True, alias="retainOnDelete")


class ModelSpec(_Model):
    name: str = DEFAULT_MODEL
    source: ModelSource = ModelSource()
    cache: ModelCache | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, alias="maxModelLen")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.cache is not None and self.source.type != "HuggingFace":
            raise ValueError("model.cache is only for model.source.type HuggingFace")
        return self


class Parallelism(_Model):
    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor * self.pipeline


class Replicas(_Model):
    min: int = Field(1, ge=0)
    max: int = Field(1, ge=1)
    desired: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Replicas:
        if self.min > self.max:
            raise ValueError("replicas.min must be <= replicas.max")
        if self.desired is not None and not self.min <= self.desired <= self.max:
            raise ValueError("replicas.desired must lie in [replicas.min, replicas.max]")
        return self


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")


class Resources(_Model):
    gpu_resource_name: str = Field("nvidia.com/gpu", alias="gpuResourceName")
    gpus_per_pod: int | None = Field(None, alias="gpusPerPod", ge=0)
    gpus_per_node: int = Field(8, alias="gpusPerNode", ge=1)
    cpu: str | int = "2"
    memory: str | int = "8Gi"  # unset in the CR: sized from the model for HuggingFace sources
    gpu_memory: str | int = Field("80Gi", alias="gpuMemory")
    shm_size: str | int = Field("1Gi", alias="shmSize")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: tuple[Toleration, ...] = ()


class AdminTokenSecret(SecretKey):
    key: str = "token"


class ApiKeySecret(SecretKey):
    key: str = "api-key"


class EngineSpec(_Model):
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", alias="imagePullPolicy"
    )
    policy: Literal["sarathi", "vllm", "orca", "static"] = "sarathi"
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, alias="blockSize")
    max_num_seqs: int = Field(256, alias="maxNumSeqs", ge=1)
    prefix_caching: bool = Field(True, alias="prefixCaching")
    port: int = Field(8000, ge=1, le=65535)
    drain_seconds: int = Field(120, alias="drainSeconds", ge=0)
    admin_token_secret: AdminTokenSecret | None = Field(None, alias="adminTokenSecret")
    api_key_secret: ApiKeySecret | None = Field(None, alias="apiKeySecret")


class PodSettings(_Model):
    """spec.pod: Kubernetes pod fields passed through as written (the CRD schema checks their shape, the API
    server their contents when the workload is applied)."""

    image_pull_secrets: tuple[dict[str, Any], ...] = Field((), alias="imagePullSecrets")
    priority_class_name: str | None = Field(None, alias="priorityClassName")
    env: tuple[dict[str, Any], ...] = ()
    env_from: tuple[dict[str, Any], ...] = Field((), alias="envFrom")
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = Field((), alias="volumeMounts")
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: tuple[dict[str, Any], ...] = Field((), alias="topologySpreadConstraints")

    @model_validator(mode="after")
    def _check(self) -> PodSettings:
        volumes = {v.get("name") for v in self.volumes}
        for m in self.volume_mounts:
            if m.get("name") not in volumes:
                raise ValueError(f"pod.volumeMounts[].name {m.get('name')!r} must name one of pod.volumes")
        return self


class Budget(_Model):
    """spec.budget: how an iteration is budgeted. `time` (the default): each iteration's prefill is what the
    engine's calibrated cost model fits in `timeTarget` x the strictest P99 TBT SLO among the clusters
    decoding in it, up to `max` tokens; the controller tunes the target. `tokens`: a token budget that
    starts at `initial` and that the controller moves inside [min, max]. Unset, the mode is `tokens` when
    the spec pins `initial` (and for baseline policies, which take a token budget), else `time`
    (SarathiSpec.budget_mode)."""

    mode: Literal["time", "tokens"] | None = None
    time_target: float = Field(0.8, alias="timeTarget", gt=0, le=1)
    initial: int | None = Field(None, ge=1)
    min: int = Field(128, ge=1)
    max: int = Field(4096, ge=1)
    align: int = Field(32, ge=1)
    # the engine's --chunk-context-scale: prefill chunks charged for the context before them; None = plain
    chunk_context_scale: int | None = Field(None, alias="chunkContextScale", ge=1)

    @model_validator(mode="after")
    def _check(self) -> Budget:
        if self.min > self.max:
            raise ValueError("budget.min must be <= budget.max")
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError("budget.initial must lie in [budget.min, budget.max]")
        if any(v % self.align for v in (self.initial or self.min, self.min, self.max)):
            raise ValueError("budget.initial, budget.min and budget.max must be multiples of budget.align")
        return self

    @property
    def initial_tokens(self) -> int:
        """The token budget engines start with in tokens mode: `initial`, else 512 inside [min, max]."""
        if self.initial is not None:
            return self.initial
        return max(self.min, min(self.max, DEFAULT_INITIAL_TOKENS // self.align * self.align))


class CostModelSpec(_Model):
    """Seconds per iteration, fitted on the serving hardware: the coefficients of a `stallfree profile`
    cost_model.json under the CRD's names (const, prefill_tokens -> prefillTokens, ...)."""

    const: float = Field(gt=0)
    prefill_tokens: float = Field(0.0, alias="prefillTokens", ge=0)
    decode_tokens: float = Field(0.0, alias="decodeTokens", ge=0)
    prefill_attn: float = Field(0.0, alias="prefillAttn", ge=0)
    decode_attn: float = Field(0.0, alias="decodeAttn", ge=0)
    prefill_chunks: float = Field(0.0, alias="prefillChunks", ge=0)

    def coefficients(self) -> dict[str, float]:
        """Under the profiler's feature names."""
        return self.model_dump(by_alias=False)


class ControllerSpec(_Model):
    enabled: bool = True
    interval_seconds: int = Field(15, alias="intervalSeconds", ge=1)
    window_seconds: int = Field(60, alias="windowSeconds", ge=5)
    prometheus_url: str | None = Field(None, alias="prometheusUrl")
    cost_model: CostModelSpec | None = Field(None, alias="costModel")


class Admission(_Model):
    max_waiting: int = Field(256, alias="maxWaiting", ge=0)
    max_running: int | None = Field(None, alias="maxRunning", ge=1)


class TrafficCluster(_Model):
    """One traffic cluster. The builders copy the CR's item verbatim into the engine config, so the raw
    mapping is what counts there; this model is for checks and for the budget controller."""

    name: str
    match: dict[str, str | int] | None = None
    slo: dict[str, float] | None = None
    chunk_cap: int | None = Field(None, alias="chunkCap", ge=1)
    max_waiting: int | None = Field(None, alias="maxWaiting", ge=0)
    max_running: int | None = Field(None, alias="maxRunning", ge=1)
    priority: int = 0


class SarathiSpec(_Model):
    """A validated, defaulted SarathiDeployment spec."""

    model: ModelSpec = ModelSpec()
    parallelism: Parallelism = Parallelism()
    replicas: Replicas = Replicas()
    resources: Resources = Resources()
    pod: PodSettings = PodSettings()
    engine: EngineSpec = EngineSpec()
    slo: Slo = Slo()  # spec.slo, camelCase on the wire (stallfree.slo parses it); the CRD's defaults
    budget: Budget = Budget()
    traffic_clusters: tuple[TrafficCluster, ...] = Field((), alias="trafficClusters")
    controller: ControllerSpec = ControllerSpec()
    admission: Admission = Admission()

    @field_validator("slo", mode="before")
    @classmethod
    def _parse_slo(cls, v: Any) -> Slo:
        return v if isinstance(v, Slo) else Slo.from_json(v)

    @model_validator(mode="after")
    def _check(self) -> SarathiSpec:
        names = [c.name for c in self.traffic_clusters]
        if len(names) != len(set(names)):
            raise ValueError("trafficClusters names must be unique")
        for c in self.traffic_clusters:
            if c.chunk_cap is not None and c.chunk_cap > self.budget.max:
                raise ValueError(f"trafficClusters[{c.name}].chunkCap must not exceed budget.max")
        if self.resources.gpus_per_pod == 0 and self.parallelism.gpus_per_replica != 1:
            raise ValueError(
                "resources.gpusPerPod 0 (CPU only) needs parallelism.tensor = parallelism.pipeline = 1"
            )
        gpp, total = self.gpus_per_pod, self.parallelism.gpus_per_replica
        if gpp and total % gpp:
            raise ValueError("resources.gpusPerPod must divide parallelism.tensor x parallelism.pipeline")
        if self.budget.mode == "time" and self.engine.policy != "sarathi":
            raise ValueError(
                f"budget.mode time budgets sarathi's iterations; engine.policy {self.engine.policy} takes a "
                "token budget (budget.mode tokens)"
            )
        return self

    # ---- derived values the builders share ----------------------------------------------------------
    def cluster_slo(self, c: TrafficCluster) -> Slo:
        """A traffic cluster's objectives: its own `slo`, the ones it leaves out taken from spec.slo (as the
        builders write it into the engine config)."""
        return Slo.from_json(c.slo or {}, base=self.slo, where=f"trafficClusters[{c.name}].slo")

    @property
    def budget_mode(self) -> Literal["time", "tokens"]:
        """budget.mode, or when unset: tokens for a spec that pins budget.initial or runs a baseline policy
        (they take a token budget), else time."""
        if self.budget.mode is not None:
            return self.budget.mode
        return "tokens" if self.budget.initial is not None or self.engine.policy != "sarathi" else "time"

    @property
    def time_target(self) -> float | None:
        """The engines' time target (budget.timeTarget) in time mode; None in tokens mode."""
        return self.budget.time_target if self.budget_mode == "time" else None

    @property
    def gpus_per_pod(self) -> int:
        """GPUs each engine pod requests (0 = CPU only)."""
        if self.resources.gpus_per_pod is not None:
            return self.resources.gpus_per_pod
        return min(self.parallelism.gpus_per_replica, self.resources.gpus_per_node)

    @property
    def pods_per_replica(self) -> int:
        """1 when a replica fits on one node, else the number of nodes (pods) one replica spans."""
        gpp = self.gpus_per_pod
        return 1 if gpp == 0 else max(1, self.parallelism.gpus_per_replica // gpp)

    @property
    def multi_node(self) -> bool:
        return self.pods_per_replica > 1

    def replica_count(self, controller_choice: int | None = None) -> int:
        """Replicas to run: the controller's choice (clamped to [min, max]) when it made one, else
        spec.replicas.desired, else spec.replicas.min."""
        if controller_choice is not None and self.controller.enabled:
            return max(self.replicas.min, min(self.replicas.max, controller_choice))
        return self.replicas.desired if self.replicas.desired is not None else self.replicas.min


def parse_spec(spec: dict) -> SarathiSpec:
    """Validate a CR's spec; raises ValueError (pydantic's ValidationError is one) naming the field."""
    return SarathiSpec.model_validate(spec or {})
