"""kopf handlers: thin wrappers that delegate to stallfree.operator.reconcile.

Handlers are registered on a registry built by make_registry(config), so start-up settings (the timer
period among them) are read once and passed down. A per-resource timer for the budget controller
(stallfree.operator.controller) is added to the same registry.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from stallfree.operator.builders.meta import LABEL_DEPLOYMENT, MANAGED_BY
from stallfree.operator.kube import Kube
from stallfree.operator.reconcile import OperatorConfig, Reconciler
from stallfree.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION
from stallfree.operator.status import differs, merge_conditions

log = logging.getLogger(__name__)
ANNOTATION_PREFIX = "serving.stallfree.dev"


def _invalid_spec_status(body: dict, message: str) -> dict:
    g = body["metadata"].get("generation", 1)
    cond = {
        "type": "Degraded",
        "status": "True",
        "reason": "InvalidSpec",
        "message": message,
        "observedGeneration": g,
    }
    return {
        "phase": "Degraded",
        "conditions": merge_conditions((body.get("status") or {}).get("conditions"), [cond]),
    }


def _api_message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


def _run(reconciler: Reconciler, body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
    def record(reason: str, message: str) -> None:
        logger.info("%s", message)
        kopf.info(body, reason=reason, message=message)  # a Kubernetes Event on the SarathiDeployment

    try:
        status = reconciler.reconcile(dict(body), record)
    except (ValidationError, ValueError) as e:
        patch.status.update(_invalid_spec_status(dict(body), str(e)))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    except ApiException as e:
        detail = _api_message(e)
        # The API server refused a child built from the spec (e.g. a spec.pod.affinity whose insides only the
        # pod schema checks): 422 when a value is invalid, 500 "failed to create typed patch object" when
        # server-side apply meets a wrong type. Say so on the resource, and retry slowly.
        if e.status == 422 or (e.status == 500 and "failed to create typed patch object" in detail):
            message = f"the API server refused a child: {detail}"
            patch.status.update(_invalid_spec_status(dict(body), message))
            kopf.warn(body, reason="InvalidSpec", message=message)
            raise kopf.TemporaryError(message, delay=60) from e
        # Conflicts, throttling, a webhook or API server hiccup, or missing RBAC: try again shortly.
        raise kopf.TemporaryError(f"Kubernetes API error {e.status}: {e.reason}", delay=10) from e
    if differs(body.get("status"), status):
        patch.status.update(status)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    # The CRD's status has a structural schema (no room for kopf's own fields): keep kopf's bookkeeping
    # in annotations instead.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = True
    # kopf.info()/kopf.warn() post Kubernetes Events at INFO and above. Handler log lines do not (kopf's
    # settings.posting.loggers stays off): handlers post the Events they mean explicitly.
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    # kopf holds its finalizer until every timer of a deleted resource has exited. A timer caught mid-run (a
    # resync, a budget-controller step waiting on Prometheus) does not exit at once, and kopf then looks
    # again only after cancellation_polling: 60 s by default, which held `kubectl delete` for a minute.
    settings.background.cancellation_polling = 1.0


def make_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In-cluster service account, else $KUBECONFIG: the same credentials stallfree.operator.kube uses.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings)
        memo.reconciler = Reconciler(Kube(), config)
        log.info(
            "stallfree operator: engine image %s, resync every %ss",
            config.engine_image,
            config.resync_seconds,
        )

    # The resource filters are spelled out on each decorator (not **dict) so they stay type-checked.
    @kopf.on.create(group=GROUP, version=VERSION, plural=PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(group=GROUP, version=VERSION, plural=PLURAL, id="reconcile", registry=registry)
    @kopf.on.resume(group=GROUP, version=VERSION, plural=PLURAL, id="reconcile", registry=registry)
    def reconcile(body: kopf.Body, patch: kopf.Patch, logger: Any, memo: kopf.Memo, **_: Any) -> None:
        _run(memo.reconciler, body, patch, logger)

    @kopf.timer(
        group=GROUP,
        version=VERSION,
        plural=PLURAL,
        id="resync",
        interval=config.resync_seconds,
        initial_delay=config.resync_seconds,
        registry=registry,
    )
    def resync(body: kopf.Body, patch: kopf.Patch, logger: Any, memo: kopf.Memo, **_: Any) -> None:
        """Corrects drift (a child edited or deleted by hand) and refreshes the status."""
        _run(memo.reconciler, body, patch, logger)

    @kopf.on.delete(
        group=GROUP, version=VERSION, plural=PLURAL, id="deleted", optional=True, registry=registry
    )
    def deleted(name: str, logger: Any, **_: Any) -> None:
        # Children carry owner references: the garbage collector removes them; nothing blocks deletion.
        logger.info("SarathiDeployment %s deleted; its children go with it", name)

    # Our pods and Deployments: managed by us and naming their SarathiDeployment.
    @kopf.on.event(
        "pods",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_DEPLOYMENT: kopf.PRESENT},
        registry=registry,
    )
    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_DEPLOYMENT: kopf.PRESENT},
        registry=registry,
    )
    def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        """A pod or Deployment of ours moved: refresh the owner's status now rather than at the next resync."""
        meta = body["metadata"]
        refresh_status(memo.reconciler, meta["namespace"], meta["labels"][LABEL_DEPLOYMENT])

    # The budget controller: one timer per SarathiDeployment on the same registry (issue 6).
    from stallfree.operator.controller.kopf_timer import register as register_budget_controller

    register_budget_controller(registry, config)
    return registry


def refresh_status(reconciler: Reconciler, namespace: str, name: str) -> None:
    kube = reconciler.kube
    try:
        body = kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        ctx = reconciler.context(body)
        status = reconciler.status(ctx, body)
        if differs(body.get("status"), status):
            kube.patch_status(API_VERSION, KIND, namespace, name, status)
    except (ValidationError, ValueError):
        return  # the main handler reports invalid specs
    except ApiException as e:
        log.warning("could not refresh status of %s/%s: %s %s", namespace, name, e.status, e.reason)
