"""Plain values the budget controller works on: what it reads, what it may set, and what it decided.

No I/O and no third-party imports: the decision core, the Prometheus source, local mode and the kopf timer
all pass these around.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from stallfree.slo import Slo


@dataclass(frozen=True, slots=True)
class Knobs:
    """The per-cluster settings the controller tunes (None = not limited)."""

    chunk_cap: int | None = None
    max_waiting: int | None = None
    max_running: int | None = None

    def as_engine(self) -> dict[str, int]:
        """The engine admin API / engine.yaml spelling, unset values left out."""
        out = {"chunkCap": self.chunk_cap, "maxWaiting": self.max_waiting, "maxRunning": self.max_running}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """User intent for one traffic cluster (from the SarathiDeployment spec): never written by us."""

    name: str
    slo: Slo = field(default_factory=Slo)
    priority: int = 0
    knobs: Knobs = field(default_factory=Knobs)  # the spec's chunkCap / maxWaiting / maxRunning


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Bounds and dynamics of the loop, built once from the spec (budget, replicas, controller)."""

    budget_min: int = 128
    budget_max: int = 4096
    align: int = 32
    replicas_min: int = 1
    replicas_max: int = 1
    interval_s: float = 15.0
    # Hysteresis band on the SLO ratio observed / objective: above `violate` is a violation, below `slack`
    # is slack worth using; in between the controller holds.
    violate: float = 1.0
    slack: float = 0.8
    # Where a new budget aims: the cost model's predicted TBT at `target` x the strictest TBT SLO.
    target: float = 0.85
    # With a cost model trusted in absolute terms: a budget whose modelled full iteration exceeds `guard` x
    # the strictest TBT SLO among clusters with traffic is cut (to `target`) before a stall is observed.
    guard: float = 0.9
    # Largest relative step up per decision (down steps follow the cost model, at least one tile).
    max_grow: float = 0.5
    # Intervals to wait after a change before growing again / shrinking again.
    grow_cooldown: int = 2
    shrink_cooldown: int = 1
    # Consecutive intervals of slack before scaling in or restoring shed load.
    scale_in_after: int = 6
    scale_cooldown: int = 4
    # Intervals after a change before a running cap is tightened again (its effect is seen sooner).
    cap_cooldown: int = 2
    # Fraction of modelled prefill capacity above which arrivals count as more than the budget serves.
    overload: float = 0.95
    # Intervals before this one whose worst TBT a raise must also have slack in (peak hold for raising):
    # one metrics window plus one interval, so that a window holding only a lull cannot erase the peak
    # the window before it saw (loop_inputs derives it from the spec's window and interval).
    raise_memory: int = 4
    # Shedding never lowers a cluster's maxWaiting below this.
    min_max_waiting: int = 1
    # The user's budget (spec.budget.initial): after lasting slack a lowered budget steps back up to it.
    budget_home: int | None = None
    # Time mode (spec.budget.mode time): the spec's time target, the share of the strictest P99 TBT SLO an
    # iteration's predicted time may take; the controller lowers it on a TBT violation and raises it back up
    # to this value, never above. None: tokens mode (the controller moves the token budget instead).
    time_target: float | None = None
    # The lowest time target the controller sets (or the spec's, when that is lower), and the least a
    # change moves it.
    time_target_min: float = 0.2
    time_target_step: float = 0.05
    # Calibration health: above this P95 of |predicted / observed - 1| of the engines' iteration times, the
    # cost model the engines budget with is miscalibrated and the time target is not raised.
    calibration_limit: float = 0.5

    def __post_init__(self) -> None:
        if self.align < 1:
            raise ValueError(f"budget.align must be >= 1, got {self.align}")
        if not 1 <= self.budget_min <= self.budget_max:
            raise ValueError(
                f"budget.min must lie in [1, budget.max], got {self.budget_min}..{self.budget_max}"
            )
        if self.budget_min % self.align or self.budget_max % self.align:
            raise ValueError("budget.min and budget.max must be multiples of budget.align")
        if not 0 <= self.replicas_min <= self.replicas_max:
            raise ValueError(
                f"replicas.min must be <= replicas.max, got {self.replicas_min}..{self.replicas_max}"
            )
        if not 0 < self.slack < self.violate:
            raise ValueError("hysteresis needs 0 < slack < violate")
        if not 0 < self.target < self.guard:
            raise ValueError("budget targets need 0 < target < guard")
        if self.raise_memory < 0:
            raise ValueError(f"raise_memory must be >= 0, got {self.raise_memory}")
        if self.time_target is not None and not 0 < self.time_target <= 1:
            raise ValueError(f"budget.timeTarget must be in (0, 1], got {self.time_target}")
        if not 0 < self.time_target_min <= 1 or not 0 < self.time_target_step < 1:
            raise ValueError("time targets need 0 < time_target_min <= 1 and 0 < time_target_step < 1")
        if not self.calibration_limit > 0:
            raise ValueError(f"calibration_limit must be > 0, got {self.calibration_limit}")

    def clamp_budget(self, value: float, *, up: bool = False) -> int:
        """Round to the tile (down, or up with up=True) and keep inside [min, max]."""
        a = self.align
        tiles = -(-int(value) // a) if up else int(value) // a
        return max(self.budget_min, min(self.budget_max, tiles * a))

    @property
    def time_target_floor(self) -> float:
        """The lowest time target the controller sets (time mode)."""
        return min(self.time_target_min, self.time_target or 1.0)

    def clamp_time_target(self, value: float) -> float:
        """Round to 0.01 and keep inside [time_target_floor, the spec's time target] (time mode)."""
        return max(self.time_target_floor, min(self.time_target or 1.0, round(value, 2)))


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the controller sets on the fleet: one budget, per-cluster knobs, a replica count. In time
    mode the budget is the time target; token_budget then stays the cap of an iteration (spec.budget.max)."""

    token_budget: int
    replicas: int
    clusters: dict[str, Knobs] = field(default_factory=dict)
    time_target: float | None = None  # time mode: the time target in force; None = tokens mode

    def knobs(self, name: str) -> Knobs:
        return self.clusters.get(name, Knobs())

    def with_knobs(self, name: str, **changes: int | None) -> Settings:
        clusters = dict(self.clusters)
        clusters[name] = replace(self.knobs(name), **changes)
        return replace(self, clusters=clusters)

    def engine_patch(self) -> dict:
        """The PATCH /admin/v1/config document for these settings (timeTarget only in time mode)."""
        doc: dict = {"tokenBudget": self.token_budget}
        if self.time_target is not None:
            doc["timeTarget"] = self.time_target
        doc["trafficClusters"] = {n: k.as_engine() for n, k in sorted(self.clusters.items())}
        return doc


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """What was observed for one traffic cluster over the window; None = no sample (no traffic)."""

    name: str
    tbt_p99: float | None = None
    ttft_p99: float | None = None
    scheduling_delay_p50: float | None = None
    waiting: float = 0.0
    waiting_trend: float = 0.0  # requests per second the queue grows (+) or drains (-)
    running: float = 0.0
    arrival_rate: float = 0.0  # requests per second
    prefill_token_rate: float = 0.0  # prompt tokens arriving per second
    rejection_rate: float = 0.0  # 429s per second
    # Mean prompt tokens of the requests that arrived in the window (prefill-token rate / arrival rate; 0
    # with no arrivals): the cost model's context, and the feedforward's longest prompt present.
    mean_context: float = 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of the fleet's metrics."""

    time: float
    clusters: dict[str, ClusterSnapshot]
    replicas_seen: int = 1  # engine replicas that reported
    kv_cache_usage: float | None = None
    # The engines' cost-model error: P95 of |predicted / observed - 1| of their last iterations' times,
    # worst engine (stallfree_cost_model_error_ratio{quantile="0.95"}); None when none reports it yet.
    cost_model_error: float | None = None

    def cluster(self, name: str) -> ClusterSnapshot:
        return self.clusters.get(name, ClusterSnapshot(name=name))


@dataclass(frozen=True, slots=True)
class State:
    """The controller's memory between decisions (kept in status so a restart does not jump)."""

    intervals_since_change: int = 1_000
    intervals_since_scale: int = 1_000
    slack_streak: int = 0
    last_direction: int = 0  # the last change (not a queue bound): +1 raised the budget, -1 cut it, 0 other
    cut_slo: float | None = None  # the strictest P99 TBT SLO (s) among the clusters the last cut was aimed at
    # Each of the last `raise_memory` intervals' (cluster, observed/SLO P99 TBT) pairs, oldest first.
    recent_tbt: tuple[tuple[tuple[str, float], ...], ...] = ()


# Actions, in the words used in status, Events and the decisions metric.
HOLD, RAISE, LOWER, SCALE_OUT, SCALE_IN, SHED, RESTORE, CAP = (
    "hold",
    "raise",
    "lower",
    "scale-out",
    "scale-in",
    "shed",
    "restore",
    "cap",
)
ACTIONS = (HOLD, RAISE, LOWER, SCALE_OUT, SCALE_IN, SHED, RESTORE, CAP)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to set next and why. `actions` maps cluster name (or "" for the fleet) to an action word."""

    settings: Settings
    state: State
    action: str
    reason: str
    cluster_actions: dict[str, str] = field(default_factory=dict)
    cluster_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.action != HOLD
