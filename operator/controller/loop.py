"""One control step: read a snapshot, decide, apply, and remember what it saw and did.

Shared by local mode (engines' metrics or a local Prometheus, admin API) and the kopf timer (Prometheus,
every engine pod, CR status). Missing or stale metrics hold the last good settings and say why (`holding`;
stallfree.operator.status.controller_status turns that into the MetricsAvailable condition): the loop
never guesses.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from stallfree.costmodel.model import BUILTIN, CostModel
from stallfree.operator.controller.applier import ApplyFailed
from stallfree.operator.controller.cooldowns import all_pending, none_pending
from stallfree.operator.controller.decide import decide, initial_settings, with_caps
from stallfree.operator.controller.prometheus import MetricsUnavailable
from stallfree.operator.controller.types import (
    HOLD,
    ClusterSpec,
    ControllerConfig,
    Decision,
    Settings,
    Snapshot,
    State,
)

log = logging.getLogger(__name__)


class Source(Protocol):
    def snapshot(self, window_s: float, clusters: list[str]) -> Snapshot: ...


Applier = Callable[[Settings], None]  # applier.EngineApplier, or local mode's wrapper around one


@dataclass(slots=True)
class Step:
    """What one step saw and did (for the live view, the metrics and the figures)."""

    time: float
    settings: Settings
    action: str
    reason: str
    snapshot: Snapshot | None
    holding: bool
    decision: Decision | None = None
    slo_met: dict[str, bool] = field(default_factory=dict)  # clusters with samples: every SLO held


@dataclass(slots=True)
class ControlLoop:
    specs: Sequence[ClusterSpec]
    config: ControllerConfig
    source: Source
    apply: Applier
    settings: Settings  # in force now (from status / the engines' config on restart, else the spec)
    window_s: float = 60.0
    min_window_s: float = 5.0
    model: CostModel = BUILTIN
    clock: Callable[[], float] = time.time
    # A fresh loop waits out the cooldowns before its first change: a restarted controller does not jump
    # (adopt() drops them when it finds the spec's own settings in force).
    state: State = field(default_factory=lambda: all_pending(State()))
    holding: str | None = None  # why settings are held (missing data / failed apply); None when not
    apply_error: str | None = None  # the last apply's failure while it lasts (holding says so too)
    last_change: float = field(default=0.0)
    last: Step | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=2000))
    observers: list[Callable[[Step], None]] = field(default_factory=list)
    initial: Settings | None = field(default=None, init=False)  # the settings the loop started from

    def __post_init__(self) -> None:
        self.initial = self.settings
        if not self.last_change:
            self.last_change = self.clock()

    @classmethod
    def start(
        cls, specs: Sequence[ClusterSpec], config: ControllerConfig, token_budget: int, replicas: int, **kw
    ):
        return cls(
            specs=specs, config=config, settings=initial_settings(specs, config, token_budget, replicas), **kw
        )

    def effective_window(self, now: float) -> float:
        """The metrics window: samples since the last change only (they describe the settings in force),
        but at least min_window_s and at most window_s."""
        return max(self.min_window_s, min(self.window_s, now - self.last_change))

    def step(self) -> Step:
        now = self.clock()
        names = [s.name for s in self.specs]
        try:
            snap = self.source.snapshot(self.effective_window(now), names)
        except MetricsUnavailable as e:
            self.holding, self.apply_error = str(e), None
            log.warning("holding settings: %s", e)
            return self._record(
                Step(now, self.settings, HOLD, f"holding last good settings: {e}", None, True)
            )
        d = decide(snap, self.settings, self.state, self.specs, self.config, self.model)
        try:
            self.apply(d.settings)
        except ApplyFailed as e:
            self.apply_error = str(e)
            self.holding = f"could not apply settings: {e}"
            log.warning("%s", self.holding)
            return self._record(Step(now, self.settings, HOLD, self.holding, snap, True, d))
        self.holding = self.apply_error = None
        met = {s.name: m for s in self.specs if (m := s.slo.met(snap.cluster(s.name))) is not None}
        if d.settings != self.settings:
            self.last_change = now
        self.settings, self.state = d.settings, d.state
        if d.changed:
            log.info("%s: %s", d.action, d.reason)
        return self._record(Step(now, d.settings, d.action, d.reason, snap, False, d, met))

    def _record(self, step: Step) -> Step:
        self.last = step
        self.history.append(step)
        for obs in self.observers:
            obs(step)
        return step

    def adopt(self, settings: Settings) -> None:
        """Take settings found in force (engine config, CR status) as the starting point, clamped. When they
        are the spec's own (nothing was tuned: a first start), there is no change to wait out, so the
        start-up cooldowns are dropped; tuned settings keep them (a restarted controller does not jump).
        In time mode the token budget is the cap and the time target is kept inside its bounds; in tokens
        mode a time target found is dropped."""
        cfg = self.config
        n = max(cfg.replicas_min, min(cfg.replicas_max, settings.replicas))
        merged = dict(self.settings.clusters)
        merged.update(settings.clusters)
        if cfg.time_target is None:
            b, t = cfg.clamp_budget(settings.token_budget), None
        else:
            b = cfg.budget_max
            t = cfg.clamp_time_target(settings.time_target or cfg.time_target)
        found = replace(settings, token_budget=b, replicas=n, clusters=merged, time_target=t)
        # Compared on this spec's clusters only: an engine may report others.
        ours = replace(found, clusters={s.name: found.knobs(s.name) for s in self.specs})
        if self.last is None and with_caps(ours, self.specs, b) == self.initial:
            self.state = none_pending(self.state)
        self.settings = found
