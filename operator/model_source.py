"""Reading a HuggingFace source at reconcile: the model's shape from the hub, for sizing and status.

Hub calls go through stallfree.engine.hub (the same code the init container runs), with a timeout, a
token read from the Secret the spec names, and a small cache so the resync timer does not call the hub
every period. A failure never raises: it comes back as a HubError for the ModelReady condition. When the
hub cannot be reached, the shape recorded in status.model for the same source stands in, so pods keep
their sizing (and do not roll) through a hub outage.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass

from stallfree.engine.hub import HubError, HubRef, model_facts
from stallfree.operator.kube import Kube
from stallfree.operator.sizing import ModelShape
from stallfree.operator.spec import ModelSource

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourceFacts:
    """What is known about a HuggingFace source right now."""

    ref: HubRef
    shape: ModelShape | None = None
    commit: str | None = None
    error: HubError | None = None  # the last read failed (shape may still come from the status)


def shape_from_status(status: dict | None, uri: str) -> tuple[ModelShape, str | None] | None:
    """The shape the operator recorded in status.model for this source, if any."""
    m = (status or {}).get("model") or {}
    keys = ("weightBytes", "layers", "kvHeads", "headDim", "contextLength")
    if m.get("source") != uri or any(m.get(k) is None for k in keys):
        return None
    shape = ModelShape(m["weightBytes"], m["layers"], m["kvHeads"], m["headDim"], m["contextLength"])
    return shape, m.get("commit")


class ModelSourceReader:
    """Reads and caches model facts per (namespace, source): successes for ok_ttl, failures for error_ttl."""

    def __init__(
        self,
        kube: Kube,
        default_endpoint: str | None = None,
        timeout: float = 10.0,
        ok_ttl: float = 600.0,
        error_ttl: float = 20.0,
    ) -> None:
        self.kube = kube
        self.default_endpoint = default_endpoint
        self.timeout, self.ok_ttl, self.error_ttl = timeout, ok_ttl, error_ttl
        self._cache: dict[tuple, tuple[float, SourceFacts]] = {}
        self._lock = threading.Lock()

    def endpoint(self, source: ModelSource) -> str | None:
        return source.endpoint or self.default_endpoint

    def read(self, namespace: str, source: ModelSource, status: dict | None = None) -> SourceFacts:
        ref = source.hub_ref
        assert ref is not None, "read() is for HuggingFace sources"
        secret = source.token_secret
        key = (
            namespace,
            ref.uri,
            self.endpoint(source),
            secret.name if secret else None,
            secret.key if secret else None,
        )
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < (self.error_ttl if hit[1].error else self.ok_ttl):
            facts = hit[1]
        else:
            facts = self._fetch(namespace, source, ref)
            with self._lock:
                self._cache[key] = (now, facts)
        if facts.shape is None and facts.error is not None and not facts.error.permanent:
            recorded = shape_from_status(status, ref.uri)
            if recorded is not None:  # the hub is away: keep the sizing the pods already have
                return SourceFacts(ref, recorded[0], recorded[1], facts.error)
        return facts

    def _token(self, namespace: str, source: ModelSource) -> str | None:
        secret = source.token_secret
        if secret is None:
            return None
        obj = self.kube.get("v1", "Secret", namespace, secret.name)
        if obj is None:
            raise HubError(
                "TokenSecretNotFound",
                f"Secret {namespace}/{secret.name} (model.source.tokenSecret) does not exist",
            )
        data = obj.get("data") or {}
        if secret.key not in data:
            raise HubError(
                "TokenSecretNotFound",
                f"Secret {namespace}/{secret.name} has no key {secret.key!r} (model.source.tokenSecret.key)",
            )
        return base64.b64decode(data[secret.key]).decode().strip()

    def _fetch(self, namespace: str, source: ModelSource, ref: HubRef) -> SourceFacts:
        try:
            token = self._token(namespace, source)
            facts = model_facts(ref, token=token, endpoint=self.endpoint(source), timeout=self.timeout)
            shape = ModelShape.from_config(facts.config, facts.weight_bytes)
        except HubError as e:
            log.info("model source %s: %s", ref.uri, e)
            return SourceFacts(ref, error=e)
        except ValueError as e:  # a config without the keys sizing needs
            return SourceFacts(ref, error=HubError("NotAModel", f"{ref.uri}: {e}"))
        return SourceFacts(ref, shape, facts.commit)
