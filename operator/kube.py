"""A small synchronous Kubernetes client for the reconciler (kubernetes' DynamicClient underneath).

Every write is a server-side apply with one field manager, so applying the same manifest twice changes
nothing (no new resourceVersion), and fields other managers own (an HPA's replicas, kubectl annotations)
are left alone unless we set them too.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

log = logging.getLogger(__name__)

FIELD_MANAGER = "stallfree-operator"


@dataclass(frozen=True, slots=True)
class Applied:
    """The result of one apply: the object the server holds and what happened to it."""

    obj: dict
    action: str  # "created", "updated" or "unchanged"


def load_api_client() -> k8s_client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s_client.ApiClient()


class Kube:
    def __init__(self, api_client: k8s_client.ApiClient | None = None) -> None:
        self._dyn = DynamicClient(api_client or load_api_client())
        # NOTE: the DynamicClient's discovery cache is not thread-safe, and kopf runs sync handlers in a
        # thread pool: look kinds up under a lock (requests themselves run unlocked).
        self._discovery_lock = threading.Lock()

    def _resource(self, api_version: str, kind: str):
        with self._discovery_lock:
            return self._dyn.resources.get(api_version=api_version, kind=kind)

    def has_api(self, api_version: str, kind: str) -> bool:
        """Whether the cluster serves this kind (e.g. a CRD that may or may not be installed)."""
        try:
            self._resource(api_version, kind)
        except ResourceNotFoundError:
            return False
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        res = self._resource(api_version, kind).get(namespace=namespace, label_selector=label_selector)
        return [item.to_dict() for item in res.items]

    def create(self, manifest: dict) -> dict:
        meta = manifest["metadata"]
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        return res.create(body=manifest, namespace=meta["namespace"]).to_dict()

    def apply(self, manifest: dict) -> Applied:
        """Server-side apply (create or patch), reporting whether anything changed."""
        meta = manifest["metadata"]
        before = self.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        obj = res.server_side_apply(
            body=manifest,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        ).to_dict()
        if before is None:
            action = "created"
        elif before["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            action = "updated"
        else:
            action = "unchanged"
        return Applied(obj=obj, action=action)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self._resource(api_version, kind).delete(
                name=name, namespace=namespace, body={"propagationPolicy": "Background"}
            )
        except NotFoundError:
            return False
        return True

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: dict) -> dict:
        res = self._resource(api_version, kind)
        return res.status.patch(
            body={"status": status},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        ).to_dict()
