"""Settings onto the engines: one applier for local mode and the operator.

`EngineApplier` PATCHes /admin/v1/config on every engine its `targets` callable lists now, except the ones
known to run the settings already: it remembers the document each engine took, so a step that changes
nothing (a hold) writes nothing. What differs between the modes is only where the engines are: local mode
lists its replica processes (stallfree.local.engines.EngineFleet.targets), the operator the Running pods
of a SarathiDeployment (kopf_timer.pod_targets, with the admin token from its Secret).

An engine is remembered under its incarnation key, which changes when it restarts (the pod's uid, IP and
container restarts; a local replica's port and restart count): a restarted engine starts from its config
file, not from what it was last sent, so it is sent the settings again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from stallfree.operator.controller.types import Settings

log = logging.getLogger(__name__)


class ApplyFailed(RuntimeError):
    """Settings could not be applied to (some of) the engines."""


@dataclass(frozen=True, slots=True)
class Target:
    """One engine to apply settings to."""

    base: str  # the engine's base URL, http://host:port
    name: str = ""  # what an error names (a pod's name); "" = the base URL
    key: str = ""  # its incarnation: changes when it restarts; "" = the base URL

    @property
    def label(self) -> str:
        return self.name or self.base

    @property
    def incarnation(self) -> str:
        return self.key or self.base


Targets = Callable[[], Sequence[Target]]
Token = str | Callable[[], str | None] | None  # the admin bearer token, or how to look it up when needed


class EngineApplier:
    """PATCH /admin/v1/config on every target whose incarnation has not taken these settings yet.

    A failed PATCH is remembered as not applied, so the next call tries again; ApplyFailed names every
    engine that failed. Engines that are no longer listed are forgotten."""

    def __init__(self, targets: Targets, token: Token = None, timeout_s: float = 5.0) -> None:
        self.targets = targets
        self._token = token
        self.timeout_s = timeout_s
        self.applied: dict[str, dict] = {}  # incarnation key -> the document it took

    def forget(self, key: str) -> None:
        """Send the next settings to this engine even if unchanged (it restarted under the same key)."""
        self.applied.pop(key, None)

    def token(self) -> str | None:
        return self._token() if callable(self._token) else self._token

    def __call__(self, settings: Settings) -> None:
        doc = settings.engine_patch()
        targets = list(self.targets())
        listed = {t.incarnation for t in targets}
        for key in [k for k in self.applied if k not in listed]:
            del self.applied[key]
        stale = [t for t in targets if self.applied.get(t.incarnation) != doc]
        if not stale:
            return
        token = self.token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        failed = []
        for t in stale:
            try:
                r = httpx.patch(
                    f"{t.base}/admin/v1/config", json=doc, headers=headers, timeout=self.timeout_s
                )
                r.raise_for_status()
                self.applied[t.incarnation] = doc
            except httpx.HTTPError as e:
                self.applied.pop(t.incarnation, None)
                failed.append(f"{t.label}: {e}")
        if failed:
            raise ApplyFailed("; ".join(failed))
        log.debug("settings applied to %d engine(s)", len(stale))
