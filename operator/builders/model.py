"""Where the weights come from: the model volume, the download init container and the model cache claim.

A HuggingFace source gets an init container that runs `stallfree download` into the model cache (a claim
shared by every replica when spec.model.cache.size is set, else an emptyDir per pod); the engine then
mounts the cache read-only and serves the downloaded folder. A cache that is already complete makes the
init container exit at once without a network call.
"""

from __future__ import annotations

import copy

from stallfree.operator.builders.meta import (
    MODELS_DIR,
    BuildContext,
    Owner,
    metadata,
    owner_reference,
)

DOWNLOAD_CONTAINER = "model-download"
MODEL_VOLUME = "models"
TERMINATION_LOG = "/dev/termination-log"
HF_HOME = f"{MODELS_DIR}/.hf-home"  # huggingface_hub's own files (token cache, xet chunks) on the volume


def cache_claim_name(owner: Owner) -> str:
    return f"{owner.name}-model-cache"


def engine_model_arg(ctx: BuildContext) -> str:
    """--model of `stallfree serve`: a bundled name, or the folder/file under the model mount."""
    source = ctx.spec.model.source
    if source.type == "Bundled":
        return ctx.spec.model.name
    if source.type == "PersistentVolumeClaim":
        return f"{MODELS_DIR}/{(source.path or '').strip('/')}".rstrip("/")
    if source.hub_ref is not None:
        return str(source.hub_ref.local_dir(MODELS_DIR))
    return MODELS_DIR


def model_volume(ctx: BuildContext) -> dict | None:
    """The pod volume holding the weights (None for Bundled)."""
    source, cache = ctx.spec.model.source, ctx.spec.model.cache
    if source.type == "PersistentVolumeClaim":
        return {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True},
        }
    if source.type == "HostPath":
        return {"name": MODEL_VOLUME, "hostPath": {"path": source.path, "type": "Directory"}}
    if source.type == "HuggingFace":
        if cache is not None and cache.size is not None:
            return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(ctx.owner)}}
        return {"name": MODEL_VOLUME, "emptyDir": {}}
    return None


def hub_env(ctx: BuildContext) -> list[dict]:
    """HF_TOKEN (from the spec's Secret), HF_ENDPOINT and HF_HOME for the download container."""
    source = ctx.spec.model.source
    env: list[dict] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    endpoint = source.endpoint or ctx.hub_endpoint
    if endpoint:
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    if source.token_secret is not None:
        ref = {"name": source.token_secret.name, "key": source.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return env


def download_init_container(ctx: BuildContext, security_context: dict) -> dict | None:
    """The init container that fills the model cache (None unless the source is HuggingFace). Its failure
    reason (one JSON line) reaches the container status through the termination message."""
    ref = ctx.spec.model.source.hub_ref
    if ref is None:
        return None
    pod = ctx.spec.pod
    container = {
        "name": DOWNLOAD_CONTAINER,
        "image": ctx.engine_image,
        "imagePullPolicy": ctx.spec.engine.image_pull_policy,
        "command": ["stallfree", "download"],
        "args": [ref.uri, "--download-dir", MODELS_DIR, "--termination-message-path", TERMINATION_LOG],
        "env": hub_env(ctx) + copy.deepcopy(list(pod.env)),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODELS_DIR}],
        "terminationMessagePath": TERMINATION_LOG,
        # A crash before the JSON line is written (OOM, a bad image) still leaves the log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security_context,
    }
    if pod.env_from:
        container["envFrom"] = copy.deepcopy(list(pod.env_from))
    return container


def build_cache_claim(ctx: BuildContext) -> dict | None:
    """The model cache PersistentVolumeClaim (None without spec.model.cache.size). It is owned by the
    SarathiDeployment (deleted with it) only when retainOnDelete is false; kept, a SarathiDeployment of the
    same name created later finds the weights already there."""
    cache = ctx.spec.model.cache
    if ctx.spec.model.source.type != "HuggingFace" or cache is None or cache.size is None:
        return None
    meta = metadata(ctx.owner, cache_claim_name(ctx.owner), "model-cache")
    if cache.retain_on_delete:
        del meta["ownerReferences"]
    else:
        meta["ownerReferences"] = [{**owner_reference(ctx.owner), "blockOwnerDeletion": False}]
    spec: dict = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": str(cache.size)}}}
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}
