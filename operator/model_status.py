"""The ModelReady condition and status.model: what the hub said about a HuggingFace source and how the
download init containers of the engine pods fared.

Pure functions over the facts the reconciler read and the pods it listed.
"""

from __future__ import annotations

import json

from stallfree.operator.builders.meta import BuildContext
from stallfree.operator.builders.model import DOWNLOAD_CONTAINER
from stallfree.operator.sizing import human_size

MODEL_READY = "ModelReady"
# ModelReady=False reasons that are waits, not faults (everything else also makes the CR Degraded).
WAITING_REASONS = frozenset({"Downloading", "WaitingForPods", "HubUnreachable"})


def init_container_states(pods: list[dict]) -> tuple[list[tuple[str, str]], bool, bool]:
    """(failures as (reason, message), any download finished, any download running) over the pods'
    model-download init containers. A failure's reason comes from the JSON line `stallfree download`
    writes to its termination message; a crash without one (OOM, bad image) reads DownloadFailed."""
    failures, done, running = [], False, False
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if cs.get("name") != DOWNLOAD_CONTAINER:
                continue
            state, last = cs.get("state") or {}, cs.get("lastState") or {}
            term = state.get("terminated") or {}
            if term and term.get("exitCode") == 0:
                done = True
                continue
            if "running" in state:
                running = True
            failed = term if term else last.get("terminated") or {}
            if failed and failed.get("exitCode", 0) != 0:
                failures.append(_failure(pod["metadata"]["name"], failed))
    return failures, done, running


def _failure(pod_name: str, terminated: dict) -> tuple[str, str]:
    text = (terminated.get("message") or "").strip()
    try:
        doc = json.loads(text.splitlines()[-1]) if text else {}
        return str(doc["reason"]), f"pod {pod_name}: {doc['message']}"
    except (ValueError, KeyError, TypeError):
        why = text[-300:] or terminated.get("reason") or f"exit code {terminated.get('exitCode')}"
        return "DownloadFailed", f"pod {pod_name}: model download failed: {why}"


def _cond(ok: bool | None, reason: str, message: str, generation: int) -> dict:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {
        "type": MODEL_READY,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def model_condition(ctx: BuildContext, pods: list[dict], generation: int) -> dict:
    """ModelReady for the spec's source. In order: a failed download, a permanent hub answer, a finished
    download, one in progress, a hub that cannot be reached, no pod yet."""
    source = ctx.spec.model.source
    if source.type != "HuggingFace":
        return _cond(True, "LocalSource", f"weights come from the {source.type} source", generation)
    uri = source.hub_ref.uri if source.hub_ref else source.uri or ""
    failures, done, running = init_container_states(pods)
    if failures:
        return _cond(False, failures[0][0], failures[0][1], generation)
    error = ctx.model.error if ctx.model else None
    if error is not None and error.permanent:
        return _cond(False, error.reason, error.message, generation)
    if done:
        return _cond(True, "Downloaded", f"{uri} is in the model cache", generation)
    if running:
        return _cond(False, "Downloading", f"downloading {uri} into the model cache", generation)
    if error is not None:
        return _cond(None, error.reason, error.message, generation)
    return _cond(False, "WaitingForPods", f"{uri} is downloaded when the first engine pod starts", generation)


def model_status(ctx: BuildContext) -> dict | None:
    """status.model: the source's shape and the sizing in force (None for non-HuggingFace sources)."""
    facts, sizing, spec = ctx.model, ctx.sizing, ctx.spec
    if facts is None or facts.shape is None:
        return None
    shape = facts.shape
    out = {
        "source": facts.ref.uri,
        "weightBytes": shape.weight_bytes,
        "size": human_size(shape.weight_bytes),
        "layers": shape.layers,
        "kvHeads": shape.kv_heads,
        "headDim": shape.head_dim,
        "contextLength": shape.context_length,
        "gpusPerReplica": spec.parallelism.gpus_per_replica if spec.gpus_per_pod else 0,
        "memory": str(spec.resources.memory),
    }
    if facts.commit:
        out["commit"] = facts.commit
    if sizing is not None:
        out["kvBytesPerToken"] = sizing.kv_bytes_per_token
        out["kvBytesFull"] = sizing.kv_bytes_full
    return out
