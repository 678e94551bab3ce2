"""One interval's reading: the snapshot and the spec turned into the signals the rules judge by.

`read` computes every ratio, limit and rate once, so the rules in `rules.py` compare numbers instead of
deriving them: the worst TBT ratio (observed, or predicted for a cluster with no sample yet), the worst
TTFT / scheduling-delay / queue pressure, the budget the calibrated cost model allows now and for a
raise, the modelled full iteration (with a profile trusted in absolute terms) and prefill demand against
modelled capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stallfree.costmodel.model import CostModel
from stallfree.costmodel.planning import budget_for_time, prefill_capacity
from stallfree.operator.controller.targets import is_shed
from stallfree.operator.controller.types import (
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Settings,
    Snapshot,
)

Observed = Sequence[tuple[ClusterSpec, ClusterSnapshot]]


@dataclass(frozen=True, slots=True)
class Reading:
    """What the rules judge by in one interval: what was observed, what it is judged against (spec,
    loop configuration, cost model) and the signals derived from them."""

    snap: Snapshot
    specs: Sequence[ClusterSpec]
    cfg: ControllerConfig
    model: CostModel
    absolute: bool  # the cost model's seconds are trusted as they are (a profile of this hardware)
    tbt_worst: tuple[float, str] | None  # (observed/SLO, cluster) of the worst TBT
    tbt_predicted: frozenset[str]  # clusters with requests but no TBT sample, judged on others' TBT
    pressure: tuple[float, str, str] | None  # (ratio, cluster, what) of the worst TTFT / delay / queue
    queue_only: bool  # the only pressure is a growing queue: no SLO missed yet, nothing rejected
    latency_slack: bool  # every P99 TTFT and P50 scheduling delay under `slack` x its SLO
    all_slack: bool  # every ratio under `slack` and no queue growing
    tbt_slack: bool  # every TBT ratio under `slack`
    budget_limit: int  # largest budget the calibrated cost model allows for the TBT target
    time_limit: float  # calibrated iteration seconds that keep the strictest TBT at target (inf: no data)
    # The same two for raising, from each cluster's worst TBT ratio over this and the last `raise_memory`
    # intervals (clusters with TBT samples now): a lull between bursts must not pass for slack.
    raise_slack: bool
    raise_limit: int
    tbt_now: tuple[tuple[str, float], ...]  # (cluster, TBT ratio) this interval, for State.recent_tbt
    # With a model trusted in absolute terms: (modelled full iteration at the current budget / the strictest
    # P99 TBT SLO among clusters with traffic, that cluster); budget_limit and raise_limit then keep it at
    # `target` too.
    modelled: tuple[float, str] | None
    overloaded: bool  # prefill arrivals beyond `overload` x modelled capacity
    demand: float  # prefill tokens per second, fleet-wide
    capacity: float  # modelled prefill tokens per second per replica at the current budget
    n_decode: float  # running decodes per replica
    context: float
    # The iteration budget modelled above: the token budget in force, or in time mode the one the time
    # target allows now (time_budget).
    budget: int
    tbt_peak: float | None  # the worst TBT ratio over this and the last `raise_memory` intervals

    @property
    def tbt_violation(self) -> tuple[float, str] | None:
        """The worst TBT (ratio, cluster) when it is over `violate` x its SLO (observed or predicted)."""
        return self.tbt_worst if self.tbt_worst is not None and self.tbt_worst[0] > self.cfg.violate else None

    @property
    def pressed(self) -> bool:
        """TTFT, scheduling-delay or queue pressure, or prefill arrivals beyond modelled capacity."""
        return self.pressure is not None or self.overloaded

    def tbt_slo(self, name: str) -> float:
        """The P99 TBT SLO of cluster `name`, seconds."""
        return {s.name: s.slo.tbt_p99 for s in self.specs}[name]

    @property
    def miscalibrated(self) -> bool:
        """The engines' cost model misses iteration times by more than `calibration_limit` (P95)."""
        err = self.snap.cost_model_error
        return err is not None and err > self.cfg.calibration_limit


def _ratio(observed: float | None, slo: float) -> float | None:
    return None if observed is None else observed / slo


def calibrated_limit(
    ratios: Sequence[float],
    predicted: float,
    n_decode: float,
    context: float,
    cfg: ControllerConfig,
    model: CostModel,
) -> tuple[int, float]:
    """(largest budget, iteration seconds) that keep the strictest TBT at `target`: the prediction at the
    current budget scaled by how far each observed ratio is from target (the worst one bounds)."""
    if not ratios or predicted <= 0:
        return cfg.budget_max, float("inf")
    allowed = predicted * min(cfg.target / r if r > 0 else float("inf") for r in ratios)
    return budget_for_time(model, allowed, n_decode, context, cfg.budget_min, cfg.budget_max), allowed


def tbt_ratios(obs: Observed) -> tuple[list[tuple[float, str]], dict[str, float]]:
    """Every (P99 TBT / SLO, cluster), and the part of it predicted for clusters with no sample.

    A cluster with requests in the engines but no TBT sample yet (its first prompts are still in prefill)
    will get its tokens at the iteration time the others see: every running request of a replica gets one
    token per iteration. So it is judged on the worst P99 TBT observed, against its own SLO. Otherwise chat
    arriving into a document batch's large chunks is seen only once its first tokens have stalled and the
    window holds them, intervals after the budget could have come down."""
    tbt = [(r, s.name) for s, c in obs if (r := _ratio(c.tbt_p99, s.slo.tbt_p99)) is not None]
    seen = [c.tbt_p99 for _, c in obs if c.tbt_p99 is not None]
    predicted = {
        s.name: max(seen) / s.slo.tbt_p99
        for s, c in obs
        if seen and c.tbt_p99 is None and (c.waiting > 0 or c.running > 0)
    }
    tbt += [(ratio, name) for name, ratio in predicted.items()]
    return tbt, predicted


def tbt_peaks(
    tbt: Sequence[tuple[float, str]], recent: Sequence[tuple[tuple[str, float], ...]]
) -> dict[str, float]:
    """Each cluster's worst TBT ratio over this interval and the `recent` ones; only clusters with a ratio
    now (a cluster whose traffic has gone cannot be stalled by a raise)."""
    peaks = {name: r for r, name in tbt}
    for interval in recent:
        for name, r in interval:
            if name in peaks:
                peaks[name] = max(peaks[name], r)
    return peaks


def full_iteration(
    obs: Observed, model: CostModel, cfg: ControllerConfig, budget: int, n_decode: float, context: float
) -> tuple[tuple[float, str], float, int] | None:
    """Feedforward, with a profile of this hardware: ((modelled full iteration / the strictest P99 TBT SLO
    among clusters with traffic, that cluster), `target` x that SLO, the largest budget whose full
    iteration fits in it); None with no traffic.

    A full iteration (a long prompt's chunk filling the budget) is what the P99 TBT of every running stream
    becomes once such a prompt arrives. Chat returning into a budget sized for documents would stall for a
    whole window before its P99 shows it, and a window in a lull between long prompts shows no stall at
    all. The slowest full iteration is the last chunk of a long prompt, attending over all of it: the mean
    prompt of the cluster with the longest ones stands for it."""
    live = [(s, c) for s, c in obs if c.arrival_rate > 0 or c.waiting > 0 or c.running > 0]
    if not live:
        return None
    strict = min((s for s, _ in live), key=lambda s: s.slo.tbt_p99)
    end = max(c.mean_context for _, c in live)
    full = model.iteration_time(max(budget - n_decode, 0.0), n_decode, context, end)
    ff_time = cfg.target * strict.slo.tbt_p99
    ff_limit = budget_for_time(
        model, ff_time, n_decode, context, cfg.budget_min, cfg.budget_max, prompt_end=end
    )
    return (full / strict.slo.tbt_p99, strict.name), ff_time, ff_limit


def pressures(obs: Observed, settings: Settings, cfg: ControllerConfig) -> list[tuple[float, str, str]]:
    """Every (ratio, cluster, what) of TTFT, scheduling delay, a growing queue and rejections."""
    out: list[tuple[float, str, str]] = []
    for s, c in obs:
        for r, what in (
            (_ratio(c.ttft_p99, s.slo.ttft_p99), "P99 TTFT"),
            (_ratio(c.scheduling_delay_p50, s.slo.scheduling_delay_p50), "P50 scheduling delay"),
        ):
            if r is not None:
                out.append((r, s.name, what))
        # A queue counts as growing when it gained at least a request per interval: a single arrival
        # caught between iterations at light load is not pressure (shedding on it would hurt).
        if c.waiting >= 2 and c.waiting_trend * cfg.interval_s >= 1:
            out.append((cfg.violate + c.waiting_trend, s.name, "queue growing"))
        # 429s count as pressure only at the spec's queue bound: below it the controller shed this cluster
        # itself, rejections are the intended effect, and counting them would block the slack that undoes it.
        if c.rejection_rate > 0 and not is_shed(settings, s):
            out.append((cfg.violate + c.rejection_rate, s.name, "requests rejected"))
    return out


def decodes(obs: Observed, replicas: int) -> tuple[float, float]:
    """(running decodes per replica, their mean context) the cost model is asked about."""
    running = sum(c.running for _, c in obs)
    context = sum(c.mean_context * c.running for _, c in obs) / running if running else 0.0
    return running / max(replicas, 1), context


def time_budget(snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec], model: CostModel) -> int:
    """Time mode: the iteration budget the time target allows now, as the engines size it: with a model
    trusted in absolute terms, the largest whose iteration fits the target x the strictest P99 TBT SLO
    among the clusters with requests running (within the cap, settings.token_budget); else the cap."""
    cap, target = settings.token_budget, settings.time_target
    live = [s for s in specs if snap.cluster(s.name).running > 0]
    if target is None or not live or not getattr(model, "absolute", False):
        return cap
    n_decode, context = decodes([(s, snap.cluster(s.name)) for s in specs], settings.replicas)
    seconds = target * min(s.slo.tbt_p99 for s in live)
    return budget_for_time(model, seconds, n_decode, context, 1, cap)


def read(
    snap: Snapshot,
    settings: Settings,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel,
    recent: Sequence[tuple[tuple[str, float], ...]] = (),
    budget: int | None = None,
) -> Reading:
    """The signals of one interval; `recent` holds the last intervals' TBT ratios (State.recent_tbt).
    `budget`: the iteration budget to model (time mode: time_budget), else the token budget in force."""
    replicas = max(settings.replicas, 1)
    obs = [(s, snap.cluster(s.name)) for s in specs]
    n_decode, context = decodes(obs, replicas)
    b = settings.token_budget if budget is None else budget
    predicted = model.iteration_time(max(b - n_decode, 0.0), n_decode, context)

    tbt, predicted_tbt = tbt_ratios(obs)
    # Calibrated time limit, in model seconds: scale the prediction at the current budget by how far each
    # cluster's observed P99 TBT is from target x its SLO; the strictest cluster bounds the budget.
    limit, allowed = calibrated_limit([r for r, _ in tbt], predicted, n_decode, context, cfg, model)
    peaks = tbt_peaks(tbt, recent)
    raise_limit, _ = calibrated_limit(list(peaks.values()), predicted, n_decode, context, cfg, model)
    absolute = getattr(model, "absolute", False)
    full = full_iteration(obs, model, cfg, b, n_decode, context) if absolute else None
    modelled = None
    if full is not None:  # the budget is also kept where a full iteration meets `target`
        modelled, ff_time, ff_limit = full
        limit, raise_limit = min(limit, ff_limit), min(raise_limit, ff_limit)
        allowed = min(allowed, ff_time)

    seen = pressures(obs, settings, cfg)
    worst = max(seen) if seen else None
    tbt_slack = all(r < cfg.slack for r, _ in tbt)
    demand = sum(c.prefill_token_rate for _, c in obs)
    capacity = prefill_capacity(model, b, n_decode, context)
    return Reading(
        snap=snap,
        specs=specs,
        cfg=cfg,
        model=model,
        absolute=absolute,
        tbt_worst=max(tbt) if tbt else None,
        tbt_predicted=frozenset(predicted_tbt),
        pressure=worst if worst and worst[0] > cfg.violate else None,
        queue_only=all(what == "queue growing" for r, _, what in seen if r > cfg.violate),
        latency_slack=all(r < cfg.slack for r, _, what in seen if what.startswith("P")),
        all_slack=tbt_slack and all(r < cfg.slack for r, _, _ in seen),
        tbt_slack=tbt_slack,
        budget_limit=limit,
        time_limit=allowed,
        raise_slack=all(r < cfg.slack for r in peaks.values()),
        raise_limit=min(limit, raise_limit),
        tbt_now=tuple((name, r) for r, name in tbt),
        modelled=modelled,
        overloaded=demand > cfg.overload * capacity * replicas,
        demand=demand,
        capacity=capacity,
        n_decode=n_decode,
        context=context,
        budget=b,
        tbt_peak=max(peaks.values()) if peaks else None,
    )
