"""ModelReady and status.model: the hub's answer at reconcile and the download init containers' statuses
(as the kubelet reports them) become one condition; faults also make the deployment Degraded."""

from __future__ import annotations

import dataclasses
import json

from test_builders import LLAMA_8B, make_ctx

from stallfree.engine.hub import HubError, parse_hub_uri
from stallfree.operator.model_source import SourceFacts, shape_from_status
from stallfree.operator.model_status import model_condition, model_status
from stallfree.operator.status import Observed, conditions_for

HF = {"model": {"name": "m", "source": {"type": "HuggingFace", "uri": "hf://acme/m@v2"}}}


def pod(name: str, state: dict, last: dict | None = None) -> dict:
    status = {"name": "model-download", "state": state, "lastState": last or {}}
    return {"metadata": {"name": name}, "status": {"initContainerStatuses": [status]}}


def failed(reason: str, message: str) -> dict:
    line = json.dumps({"reason": reason, "message": message})
    return {"terminated": {"exitCode": 1, "reason": "Error", "message": line + "\n"}}


def with_error(error: HubError):
    return dataclasses.replace(make_ctx(HF), model=SourceFacts(parse_hub_uri("hf://acme/m@v2"), error=error))


def test_download_states_in_order():
    ctx = make_ctx(HF, shape=LLAMA_8B)
    assert model_condition(ctx, [], 3)["reason"] == "WaitingForPods"
    running = pod("p0", {"running": {}})
    assert model_condition(ctx, [running], 3) | {} == {
        "type": "ModelReady", "status": "False", "reason": "Downloading",
        "message": "downloading hf://acme/m@v2 into the model cache", "observedGeneration": 3,
    }  # fmt: skip
    done = pod("p1", {"terminated": {"exitCode": 0, "reason": "Completed"}})
    assert model_condition(ctx, [running, done], 3)["status"] == "True"
    crash = pod(
        "p2",
        {"waiting": {"reason": "CrashLoopBackOff"}},
        failed("RevisionNotFound", "acme/m has no revision 'v2'"),
    )
    cond = model_condition(ctx, [done, crash], 3)
    assert (cond["status"], cond["reason"]) == ("False", "RevisionNotFound")
    assert cond["message"] == "pod p2: acme/m has no revision 'v2'"


def test_a_crash_without_the_json_line_keeps_the_log_tail():
    oom = pod("p0", {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": ""}})
    cond = model_condition(make_ctx(HF), [oom], 1)
    assert cond["reason"] == "DownloadFailed" and "OOMKilled" in cond["message"]
    logs = pod("p0", {"terminated": {"exitCode": 1, "message": "Traceback ...\nImportError: no hf"}})
    assert "ImportError: no hf" in model_condition(make_ctx(HF), [logs], 1)["message"]


def test_hub_answers_at_reconcile():
    gated = with_error(HubError("GatedRepo", "acme/m is gated"))
    assert model_condition(gated, [], 1)["reason"] == "GatedRepo"
    away = with_error(HubError("HubUnreachable", "cannot reach the hub"))
    assert model_condition(away, [], 1)["status"] == "Unknown"
    done = pod("p1", {"terminated": {"exitCode": 0}})
    assert model_condition(away, [done], 1)["status"] == "True"  # the cache is filled: the hub is not needed


def test_faults_degrade_waits_do_not():
    def degraded(model_ready: dict) -> dict:
        o = Observed(generation=1, desired=1, replicas=1, ready=0, updated=1, workloads_current=True,
                     model_ready=model_ready)  # fmt: skip
        conds = {c["type"]: c for c in conditions_for(o)}
        assert conds["ModelReady"] == model_ready
        return conds["Degraded"]

    ctx = make_ctx(HF)
    fault = model_condition(ctx, [pod("p", {}, failed("DiskFull", "no space left"))], 1)
    assert (degraded(fault)["status"], degraded(fault)["reason"]) == ("True", "DiskFull")
    assert degraded(model_condition(ctx, [pod("p", {"running": {}})], 1))["status"] == "False"
    local = model_condition(make_ctx({"model": {}}), [], 1)
    assert (local["status"], local["reason"]) == ("True", "LocalSource")


def test_status_model_records_the_shape_and_it_stands_in_when_the_hub_is_away():
    ctx = make_ctx({"model": {**HF["model"], "maxModelLen": 8192}}, shape=LLAMA_8B)
    status = model_status(ctx)
    assert status["size"] == "15.0Gi" and status["weightBytes"] == LLAMA_8B.weight_bytes
    assert status["gpusPerReplica"] == 1 and status["memory"] == "8Gi"
    assert status["kvBytesPerToken"] == 131072 and status["kvBytesFull"] == 131072 * 8192 * 256
    assert shape_from_status({"model": status}, "hf://acme/m@v2") == (LLAMA_8B, "0" * 40)
    assert shape_from_status({"model": status}, "hf://acme/other@main") is None
    assert model_status(make_ctx({"model": {}})) is None
