"""The decision core: one metrics snapshot in, the next settings and a reason out. Pure, no I/O.

Order of concerns, each interval (one fleet-wide action at most, so every change can be judged on its own):

1. TBT violated in any cluster -> lower the budget to where the cost model, calibrated on what was observed,
   puts P99 TBT at `target` x the strictest TBT SLO (at least one tile down). TBT comes first: a stalled
   decode is the failure users see. When that lands on the floor and the model says even the floor misses
   the target with what runs now (decode-bound), at replicas.max the running cap of step 2 comes in the
   same step rather than an interval of stalls later. A cluster with requests in the engines but no TBT
   sample yet is judged on the worst P99 TBT the others see (the iteration time its streams will get).
   With a cost model trusted in absolute terms (a profile of the serving hardware), the budget is also
   kept where a full iteration (the last chunk of a long prompt) is modelled at `target` x the strictest
   TBT SLO among clusters with traffic, and cut there as soon as it is modelled over `guard` x that SLO,
   before any stall is observed (chat arriving into a budget sized for documents).
2. TBT violated with the budget on its floor, or prefill tokens arriving faster than the budget can serve
   (cost model), or TTFT/queue pressure with no TBT slack left -> scale out (up to replicas.max), else shed
   the lowest-priority cluster with traffic. With the budget on its floor, what still makes iterations slow
   is the running decodes themselves (their number and, on CPU, their context), which only admission can
   reduce: so for TBT, shedding first caps that cluster's running requests at half of what runs now
   (maxRunning; the engine pauses the prompts over it at once, streams drain), again every `cap_cooldown`
   intervals while TBT stays violated; once it runs one request, it halves its queue bound (maxWaiting).
   With a trusted model both come in one step instead: the largest running cap with which the modelled
   iteration meets the TBT target, and the queue bound that the cluster's share of the modelled prefill
   capacity drains within `target` x its TTFT SLO (a longer queue holds only requests that will miss it).
   A growing queue or modelled overload with every SLO met may scale out, but sheds only once TTFT or
   scheduling delay has no slack left: bursts of long prompts queue up and drain, a windowed arrival
   rate is noisy, and shedding fails requests for sure.
3. TTFT, scheduling delay or a growing queue with TBT slack in every cluster -> raise the budget by
   `max_grow`, or, when prefill arrivals exceed the modelled capacity, straight to the budget the cost
   model says serves them; never past the calibrated TBT limit.
   A capped maxRunning is undone first when its own cluster shows TTFT or queue pressure with TBT slack;
   a queue bound shed for that cluster comes back a step (x2) in each interval of the raise's cooldown
   while it still rejects (it was shed for want of a larger budget, and the budget is now growing).
   Every raise (and restore) needs slack in the worst TBT of this and the last `raise_memory` intervals
   (one metrics window plus one), per cluster that still has traffic, and is calibrated on it: a
   windowed P99 read in a lull between bursts of long prompts is not slack, and a raise judged on one
   overshoots into a violation.
4. Lasting slack (`scale_in_after` intervals) -> undo shedding first, then step a lowered budget back up
   toward the spec's (`budget_home`, within the calibrated TBT limit) by half the pressure step (probing,
   like additive increase after a multiplicative decrease), then scale in when the load fits in one
   replica fewer.

Hysteresis: ratios observed/SLO between `slack` and `violate` hold, and a new budget aims at `target`
(inside that band), so a steady signal never flips direction. Cooldowns count intervals since the last change;
a TBT cut skips its cooldown after a raise, or for a cluster whose TBT SLO is stricter than the last cut aimed at.
Chunk caps follow the budget: min(spec chunkCap, budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from stallfree.costmodel.model import BUILTIN, CostModel
from stallfree.costmodel.planning import budget_for_demand, budget_for_time, prefill_capacity
from stallfree.operator.controller.types import (
    CAP,
    HOLD,
    LOWER,
    RAISE,
    RESTORE,
    SCALE_IN,
    SCALE_OUT,
    SHED,
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Decision,
    Settings,
    Snapshot,
    State,
)

DEFAULT_MAX_WAITING = 256  # what shedding starts from when neither settings nor spec bound a queue
DEFAULT_MAX_RUNNING = 256  # what a capped maxRunning is restored to when the spec sets none (>= maxNumSeqs)


@dataclass(frozen=True, slots=True)
class _Reading:
    """Derived signals for one interval."""

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


def _ratio(observed: float | None, slo: float) -> float | None:
    return None if observed is None else observed / slo


def _calibrated_limit(
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


def _read(
    snap: Snapshot,
    settings: Settings,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel,
    recent: Sequence[tuple[tuple[str, float], ...]] = (),
) -> _Reading:
    replicas = max(settings.replicas, 1)
    obs = [(s, snap.cluster(s.name)) for s in specs]
    running = sum(c.running for _, c in obs)
    n_decode = running / replicas
    context = sum(c.mean_context * c.running for _, c in obs) / running if running else 0.0
    b = settings.token_budget
    predicted = model.iteration_time(max(b - n_decode, 0.0), n_decode, context)

    tbt = [(r, s.name) for s, c in obs if (r := _ratio(c.tbt_p99, s.slo.tbt_p99)) is not None]
    # A cluster with requests in the engines but no TBT sample yet (its first prompts are still in
    # prefill) will get its tokens at the iteration time the others see: every running request of a
    # replica gets one token per iteration. So it is judged on the worst P99 TBT observed, against its
    # own SLO. Otherwise chat arriving into a document batch's large chunks is seen only once its first
    # tokens have stalled and the window holds them, intervals after the budget could have come down.
    seen = [c.tbt_p99 for _, c in obs if c.tbt_p99 is not None]
    predicted_tbt = {
        s.name: max(seen) / s.slo.tbt_p99
        for s, c in obs
        if seen and c.tbt_p99 is None and (c.waiting > 0 or c.running > 0)
    }
    tbt += [(ratio, name) for name, ratio in predicted_tbt.items()]
    tbt_worst = max(tbt) if tbt else None
    # Calibrated time limit, in model seconds: scale the prediction at the current budget by how far each
    # cluster's observed P99 TBT is from target x its SLO; the strictest cluster bounds the budget.
    limit, allowed = _calibrated_limit([r for r, _ in tbt], predicted, n_decode, context, cfg, model)
    peaks = {name: r for r, name in tbt}
    for interval in recent:
        for name, r in interval:
            if name in peaks:  # a cluster whose traffic has gone cannot be stalled by a raise
                peaks[name] = max(peaks[name], r)
    raise_limit, _ = _calibrated_limit(list(peaks.values()), predicted, n_decode, context, cfg, model)
    # Feedforward, with a profile of this hardware: a full iteration (a long prompt's chunk filling the
    # budget) is what the P99 TBT of every running stream becomes once such a prompt arrives. Chat returning
    # into a budget sized for documents would stall for a whole window before its P99 shows it, and a
    # window in a lull between long prompts shows no stall at all. So the budget is also kept where the
    # profile puts a full iteration at `target` x the strictest TBT SLO among clusters with traffic.
    # The slowest full iteration is the last chunk of a long prompt, attending over all of it: the mean
    # prompt of the cluster with the longest ones stands for it.
    modelled = None
    if getattr(model, "absolute", False):
        live = [(s, c) for s, c in obs if c.arrival_rate > 0 or c.waiting > 0 or c.running > 0]
        if live:
            strict = min((s for s, _ in live), key=lambda s: s.slo.tbt_p99)
            end = max(c.mean_context for _, c in live)
            full = model.iteration_time(max(b - n_decode, 0.0), n_decode, context, end)
            modelled = (full / strict.slo.tbt_p99, strict.name)
            ff_time = cfg.target * strict.slo.tbt_p99
            ff_limit = budget_for_time(
                model, ff_time, n_decode, context, cfg.budget_min, cfg.budget_max, prompt_end=end
            )
            limit, raise_limit = min(limit, ff_limit), min(raise_limit, ff_limit)
            allowed = min(allowed, ff_time)

    pressures: list[tuple[float, str, str]] = []
    for s, c in obs:
        for r, what in (
            (_ratio(c.ttft_p99, s.slo.ttft_p99), "P99 TTFT"),
            (_ratio(c.scheduling_delay_p50, s.slo.scheduling_delay_p50), "P50 scheduling delay"),
        ):
            if r is not None:
                pressures.append((r, s.name, what))
        # A queue counts as growing when it gained at least a request per interval: a single arrival
        # caught between iterations at light load is not pressure (shedding on it would hurt).
        if c.waiting >= 2 and c.waiting_trend * cfg.interval_s >= 1:
            pressures.append((cfg.violate + c.waiting_trend, s.name, "queue growing"))
        # 429s count as pressure only at the spec's queue bound: below it the controller shed this cluster
        # itself, rejections are the intended effect, and counting them would block the slack that undoes it.
        shed = (settings.knobs(s.name).max_waiting or DEFAULT_MAX_WAITING) < (
            s.knobs.max_waiting or DEFAULT_MAX_WAITING
        )
        if c.rejection_rate > 0 and not shed:
            pressures.append((cfg.violate + c.rejection_rate, s.name, "requests rejected"))
    worst_pressure = max(pressures) if pressures else None
    queue_only = all(what == "queue growing" for r, _, what in pressures if r > cfg.violate)
    latency_slack = all(r < cfg.slack for r, _, what in pressures if what.startswith("P"))
    tbt_slack = all(r < cfg.slack for r, _ in tbt)
    all_slack = tbt_slack and all(r < cfg.slack for r, _, _ in pressures)

    demand = sum(c.prefill_token_rate for _, c in obs)
    capacity = prefill_capacity(model, b, n_decode, context)
    overloaded = demand > cfg.overload * capacity * replicas
    return _Reading(
        tbt_worst=tbt_worst,
        tbt_predicted=frozenset(predicted_tbt),
        pressure=worst_pressure if worst_pressure and worst_pressure[0] > cfg.violate else None,
        queue_only=queue_only,
        latency_slack=latency_slack,
        all_slack=all_slack,
        tbt_slack=tbt_slack,
        budget_limit=limit,
        time_limit=allowed,
        raise_slack=all(r < cfg.slack for r in peaks.values()),
        raise_limit=min(limit, raise_limit),
        tbt_now=tuple((name, r) for r, name in tbt),
        modelled=modelled,
        overloaded=overloaded,
        demand=demand,
        capacity=capacity,
        n_decode=n_decode,
        context=context,
    )


def with_caps(settings: Settings, specs: Sequence[ClusterSpec], budget: int) -> Settings:
    """Chunk caps follow the budget: the spec's cap (the user's ceiling) but never above the budget."""
    out = settings
    for s in specs:
        cap = min(s.knobs.chunk_cap or budget, budget)
        if out.knobs(s.name).chunk_cap != cap:
            out = out.with_knobs(s.name, chunk_cap=cap)
    return out


def _shed_target(snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec], cfg: ControllerConfig):
    """The lowest-priority cluster with traffic whose queue bound can still come down (most prefill
    tokens first among equals), and its new maxWaiting; None when nothing can be shed."""
    candidates = []
    for s in specs:
        c: ClusterSnapshot = snap.cluster(s.name)
        if c.arrival_rate <= 0 and c.waiting <= 0:
            continue
        current = settings.knobs(s.name).max_waiting
        if current is None:
            current = s.knobs.max_waiting if s.knobs.max_waiting is not None else DEFAULT_MAX_WAITING
        if current > cfg.min_max_waiting:
            candidates.append((s.priority, -c.prefill_token_rate, s.name, current))
    if not candidates:
        return None
    _, _, name, current = min(candidates)
    return name, max(cfg.min_max_waiting, current // 2)


def _throttle_target(
    snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec]
) -> tuple[str, int] | None:
    """For TBT the budget cannot fix: the lowest-priority cluster with traffic, when it runs two or more
    requests per replica (or has that many under its cap), and a maxRunning of half of them; None
    otherwise (then its queue is shed instead)."""
    live = [
        s for s in specs if (c := snap.cluster(s.name)).arrival_rate > 0 or c.waiting > 0 or c.running > 0
    ]
    if not live:
        return None
    s = min(live, key=lambda s: (s.priority, -snap.cluster(s.name).prefill_token_rate))
    active = int(snap.cluster(s.name).running / max(settings.replicas, 1))
    limit = settings.knobs(s.name).max_running
    if limit is not None:  # requests over a lowered cap sit out: halve what actually runs
        active = min(active, limit)
    if active < 2:
        return None
    return s.name, active // 2


def _restore_target(settings: Settings, specs: Sequence[ClusterSpec], only: str | None = None):
    """The highest-priority shed cluster (or `only`) and its knob back toward the spec: ("max_running" |
    "max_waiting", name, value); running first, as it is what limits service. A queue bound comes back one
    step (x2) at a time; a running cap straight to the spec (the caller may stop short of it)."""
    shed = []
    for s in specs:
        if only is not None and s.name != only:
            continue
        for rank, knob, default in (
            (0, "max_running", DEFAULT_MAX_RUNNING),
            (1, "max_waiting", DEFAULT_MAX_WAITING),
        ):
            now = getattr(settings.knobs(s.name), knob)
            spec = getattr(s.knobs, knob)
            want = spec if spec is not None else default
            if now is not None and now < want:
                value = want if knob == "max_running" else min(want, max(now * 2, 1))
                shed.append((-s.priority, rank, s.name, knob, value))
    if not shed:
        return None
    _, _, name, knob, value = min(shed)
    return knob, name, value


def _reopen_target(
    snap: Snapshot, settings: Settings, specs: Sequence[ClusterSpec], pressure: tuple[float, str, str] | None
) -> tuple[str, int] | None:
    """The cluster under pressure and its maxWaiting one step back toward the spec, when it was shed and
    still rejects arrivals; None otherwise."""
    if pressure is None or snap.cluster(pressure[1]).rejection_rate <= 0:
        return None
    back = _restore_target(settings, specs, only=pressure[1])
    if back is None or back[0] != "max_waiting":
        return None
    return back[1], back[2]


def initial_settings(
    specs: Sequence[ClusterSpec], cfg: ControllerConfig, token_budget: int, replicas: int
) -> Settings:
    """Settings before any decision: the spec's knobs, chunk caps within the budget, budget and replicas
    inside their bounds."""
    b = cfg.clamp_budget(token_budget)
    n = max(cfg.replicas_min, min(cfg.replicas_max, replicas))
    base = Settings(token_budget=b, replicas=n, clusters={s.name: s.knobs for s in specs})
    return with_caps(base, specs, b)


def decide(
    snap: Snapshot,
    settings: Settings,
    state: State,
    specs: Sequence[ClusterSpec],
    cfg: ControllerConfig,
    model: CostModel = BUILTIN,
) -> Decision:
    """The next settings for the fleet. `settings` are those in force; `state` comes from the last call."""
    r = _read(snap, settings, specs, cfg, model, state.recent_tbt)
    st = replace(
        state,
        recent_tbt=(*state.recent_tbt, r.tbt_now)[-cfg.raise_memory :] if cfg.raise_memory else (),
        intervals_since_change=state.intervals_since_change + 1,
        intervals_since_scale=state.intervals_since_scale + 1,
        slack_streak=state.slack_streak + 1 if r.all_slack else 0,
    )
    b = settings.token_budget
    capped = with_caps(settings, specs, b)

    def out(
        new: Settings,
        action: str,
        reason: str,
        who: str = "",
        direction: int = 0,
        scale: bool = True,
        admission_only: bool = False,
    ) -> Decision:
        new = with_caps(new, specs, new.token_budget)
        s2 = st
        if action != HOLD:
            s2 = replace(s2, slack_streak=0)
            # A queue bound changes which arrivals are admitted, not how long an iteration takes: it is
            # judged after the scale cooldown, and the budget's own cooldown goes on counting, so a TBT
            # violation right after it is still met at once.
            if not admission_only:
                s2 = replace(s2, intervals_since_change=0, last_direction=direction)
            if scale and action in (SCALE_OUT, SCALE_IN, SHED, RESTORE):
                s2 = replace(s2, intervals_since_scale=0)
        names = [who] if who else [s.name for s in specs]
        return Decision(
            settings=new,
            state=s2,
            action=action,
            reason=reason,
            cluster_actions={n: action for n in names},
            cluster_reasons={n: reason for n in names},
        )

    absolute = getattr(model, "absolute", False)

    def fit_cap(name: str, half: int, budget: int) -> int:
        """A running cap for `name` in one step: with a model trusted in absolute terms, the largest up to
        `half` with which a full iteration at `budget` meets the TBT target (at least 1); else `half`."""
        if not absolute:
            return half
        c, reps = snap.cluster(name), max(settings.replicas, 1)
        others = max(r.n_decode - c.running / reps, 0.0)
        for k in range(half, 1, -1):
            n2 = others + k
            ctx = (r.context * r.n_decode - c.mean_context * c.running / reps + c.mean_context * k) / n2
            if model.iteration_time(max(budget - n2, 0.0), n2, max(ctx, 0.0)) <= r.time_limit:
                return k
        return 1

    def drain_bound(name: str, budget: int | None = None) -> int | None:
        """With a model trusted in absolute terms: the queue of `name` that its share of the modelled
        prefill capacity at `budget` (the current one by default; what higher-priority clusters leave)
        serves within `target` x its TTFT SLO. A longer queue only holds requests that will miss it. None
        without such a model or arrivals."""
        c = snap.cluster(name)
        if not absolute or c.arrival_rate <= 0 or c.prefill_token_rate <= 0:
            return None
        spec = next(s for s in specs if s.name == name)
        above = sum(snap.cluster(s.name).prefill_token_rate for s in specs if s.priority > spec.priority)
        capacity = r.capacity if budget is None else prefill_capacity(model, budget, r.n_decode, r.context)
        share = capacity - above / max(settings.replicas, 1)
        mean_prompt = c.prefill_token_rate / c.arrival_rate
        if mean_prompt < 1:  # less than a token a request: no meaningful rate yet
            return None
        return int(max(share, 0.0) * cfg.target * spec.slo.ttft_p99 / mean_prompt) - 1

    def escalate(why: str, decode_bound: bool = False, may_shed: bool = True) -> Decision:
        if st.intervals_since_scale < cfg.scale_cooldown:
            return out(capped, HOLD, f"{why}; waiting for the last scale/shed to take effect")
        if settings.replicas < cfg.replicas_max:
            n = settings.replicas + 1
            return out(replace(capped, replicas=n), SCALE_OUT, f"{why}: replicas {settings.replicas} -> {n}")
        if not may_shed:
            return out(capped, HOLD, f"{why}; at replicas.max, and SLOs are still met: not shedding yet")
        throttle = _throttle_target(snap, settings, specs) if decode_bound else None
        if throttle is not None:
            # A lowered cap pauses prompts at the next iteration and running streams drain within a few,
            # so it is judged after `cap_cooldown`, not the scale cooldown a new replica needs (the first
            # interval after a change still holds stalls from before it).
            if st.intervals_since_change < cfg.cap_cooldown:
                return out(capped, HOLD, f"{why}; cooling down after the last change")
            name, mr = throttle
            mr = fit_cap(name, mr, b)
            return out(
                capped.with_knobs(name, max_running=mr),
                SHED,
                f"{why}; at replicas.max ({cfg.replicas_max}): shed lowest-priority cluster {name}, "
                f"maxRunning -> {mr} per replica",
                who=name,
                scale=False,
            )
        target = _shed_target(snap, settings, specs, cfg)
        if target is None:
            return out(capped, HOLD, f"{why}; at replicas.max and nothing left to shed")
        name, mw = target
        bound = drain_bound(name)
        if bound is not None:  # in one step, not by halving over several scale cooldowns
            mw = max(cfg.min_max_waiting, min(mw, bound))
        return out(
            capped.with_knobs(name, max_waiting=mw),
            SHED,
            f"{why}; at replicas.max ({cfg.replicas_max}): shed lowest-priority cluster {name}, maxWaiting -> {mw}",
            who=name,
            admission_only=True,
        )

    def _admits(name: str, max_running: int) -> bool:
        """Whether the calibrated cost model keeps TBT within target with `name` running up to
        `max_running` per replica (from its queue) on top of what runs now."""
        c, reps = snap.cluster(name), max(settings.replicas, 1)
        extra = max(0.0, min(max_running - c.running / reps, c.waiting / reps))
        n2 = r.n_decode + extra
        ctx = (r.context * r.n_decode + c.mean_context * extra) / n2 if n2 else 0.0
        return model.iteration_time(max(b - n2, 0.0), n2, ctx) <= r.time_limit

    def _admitted(name: str, want: int) -> int | None:
        """The largest running cap for `name`, doubling from today's up to `want`, that `_admits`; None
        when not even one doubling does."""
        now = settings.knobs(name).max_running or want
        best, v = None, now
        while v < want:
            v = min(want, v * 2)
            if not _admits(name, v):
                break
            best = v
        return best

    # 1. TBT violated: shrink first.
    if r.tbt_worst and r.tbt_worst[0] > cfg.violate:
        ratio, who = r.tbt_worst
        why = f"P99 TBT of {who} at {ratio:.2f}x its SLO"
        if who in r.tbt_predicted:
            why = f"P99 TBT of {who} predicted at {ratio:.2f}x its SLO (no sample yet; others see that TBT)"
        if b > cfg.budget_min:
            # The cooldown keeps one bad window from cutting twice: after a cut (or a cap) its samples
            # still hold the stalls from before it. After a raise they were taken at a smaller budget and
            # can only understate this violation, so it is met at once. So is a violation of a TBT SLO
            # stricter than any the last cut aimed at (traffic of a stricter cluster arrived since): that
            # cut leaves it over target even once its window has cleared.
            slo = {s.name: s.slo.tbt_p99 for s in specs}
            stricter = st.last_direction == -1 and st.cut_slo is not None and slo[who] < st.cut_slo
            if st.intervals_since_change < cfg.shrink_cooldown and st.last_direction != 1 and not stricter:
                return out(capped, HOLD, f"{why}; cooling down after the last change")
            nb = cfg.clamp_budget(min(r.budget_limit, b - cfg.align))
            lowered = replace(capped, token_budget=nb)
            aim = min(slo[name] for name, _ in r.tbt_now)  # the calibrated limit holds all of them

            def cut(new: Settings, reason: str) -> Decision:
                d = out(new, LOWER, reason, direction=-1)
                return replace(d, state=replace(d.state, cut_slo=aim))

            floor_time = model.iteration_time(max(nb - r.n_decode, 0.0), r.n_decode, r.context)
            if nb == cfg.budget_min and floor_time > r.time_limit and settings.replicas >= cfg.replicas_max:
                # Decode-bound: by the calibrated model even the floor misses the target with what runs
                # now. Waiting an interval to find that out costs one more interval of stalls, so the
                # running cap comes in the same step.
                throttle = _throttle_target(snap, settings, specs)
                if throttle is not None:
                    name, mr = throttle
                    mr = fit_cap(name, mr, nb)
                    return cut(
                        lowered.with_knobs(name, max_running=mr),
                        f"{why}: budget {b} -> {nb}, and as decodes alone miss the target at the floor, "
                        f"lowest-priority cluster {name} maxRunning -> {mr} per replica",
                    )  # fmt: skip
            return cut(lowered, f"{why}: budget {b} -> {nb}")
        return escalate(f"{why} with the budget at its floor {cfg.budget_min}", decode_bound=True)

    # 1b. No stall seen yet, but by the profile a full iteration at this budget would stall the strictest
    # cluster with traffic: cut now, to where it meets `target`. Not cooled down: it reads no window.
    if r.modelled and r.modelled[0] > cfg.guard and b > cfg.budget_min:
        nb = cfg.clamp_budget(min(r.budget_limit, b - cfg.align))
        slo = {s.name: s.slo.tbt_p99 for s in specs}
        ratio, who = r.modelled
        d = out(
            replace(capped, token_budget=nb),
            LOWER,
            f"a full iteration at budget {b} is modelled at {ratio:.2f}x the P99 TBT SLO of {who} "
            f"(the strictest with traffic): budget {b} -> {nb}",
            direction=-1,
        )
        return replace(d, state=replace(d.state, cut_slo=slo[who]))

    # 2./3. Prefill overload or TTFT / queue pressure.
    if r.pressure or r.overloaded:
        if r.pressure:
            ratio, who, what = r.pressure
            why = f"{what} of {who} at {ratio:.2f}x its SLO" if what.startswith("P") else f"{what} in {who}"
        else:
            why = f"prefill arrivals {r.demand:.0f} tok/s beyond {r.capacity * settings.replicas:.0f} tok/s served"
        if r.pressure and r.raise_slack:  # a cluster capped for TBT gets its running requests back first,
            back = _restore_target(settings, specs, only=r.pressure[1])  # as far as TBT allows
            back_mr = _admitted(back[1], back[2]) if back is not None and back[0] == "max_running" else None
            if back is not None and back_mr is not None:
                if st.intervals_since_change < cfg.grow_cooldown:
                    return out(capped, HOLD, f"{why}; cooling down after the last change")
                name = back[1]
                return out(capped.with_knobs(name, max_running=back_mr), RESTORE,
                           f"{why}, TBT has slack: {name} maxRunning -> {back_mr}", who=name)  # fmt: skip
        if r.raise_slack and b < cfg.budget_max:
            step = max(b * (1 + cfg.max_grow), b + cfg.align)
            if r.overloaded:  # the cost model says how far: straight to a budget that serves the demand
                need = budget_for_demand(
                    model, r.demand / (cfg.overload * settings.replicas), r.n_decode, r.context,
                    cfg.budget_min, cfg.budget_max, cfg.align,
                )  # fmt: skip
                step = max(step, need)
            nb = cfg.clamp_budget(min(r.raise_limit, step))
            if nb > b:
                if st.intervals_since_change < cfg.grow_cooldown:
                    # The queue bound of a cluster shed for want of a larger budget comes back a step
                    # while the budget grows, or its arrivals go on failing for a reason that has gone;
                    # with a trusted model, only as far as the larger budget's capacity drains in time
                    # (on hardware where capacity hardly grows with the budget, not at all).
                    queue = _reopen_target(snap, settings, specs, r.pressure)
                    if queue is not None:
                        bound = drain_bound(queue[0], nb)
                        if bound is not None and queue[1] > max(bound, cfg.min_max_waiting):
                            queue = None
                    if queue is not None and st.intervals_since_scale >= cfg.scale_cooldown:
                        name, mw = queue
                        return out(capped.with_knobs(name, max_waiting=mw), RESTORE,
                                   f"{why}, TBT has slack and the budget is growing: {name} maxWaiting -> {mw}",
                                   who=name, admission_only=True)  # fmt: skip
                    return out(capped, HOLD, f"{why}; cooling down after the last change")
                return out(
                    replace(capped, token_budget=nb),
                    RAISE,
                    f"{why}, TBT has slack: budget {b} -> {nb}",
                    direction=1,
                )
        if r.tbt_slack and not r.raise_slack and not r.overloaded and b < cfg.budget_max:
            return out(capped, HOLD, f"{why}; TBT had no slack within the last {cfg.raise_memory} "
                       "intervals, so no raise yet")  # fmt: skip
        if r.overloaded or (r.pressure and not r.tbt_slack) or b >= cfg.budget_max:
            # A queue that grows while every SLO is met may be a burst the budget absorbs (Poisson
            # arrivals of long prompts queue up and drain, and a windowed arrival rate near capacity is
            # as often noise as overload): a replica costs nothing served, but shedding fails requests
            # for sure. So it sheds for a missed SLO or rejections, or for overload once queueing has
            # eaten the TTFT / scheduling-delay slack.
            return escalate(
                f"{why}, no TBT slack to raise the budget" if not r.overloaded else why,
                may_shed=not r.queue_only or (r.overloaded and not r.latency_slack),
            )
        return out(capped, HOLD, f"{why}; the calibrated cost model allows no larger budget")

    # 4. Lasting slack: give back what was taken.
    if st.slack_streak >= cfg.scale_in_after and st.intervals_since_scale >= cfg.scale_cooldown:
        restore = _restore_target(settings, specs)
        if restore is not None:
            knob, name, value = restore
            label = "maxRunning" if knob == "max_running" else "maxWaiting"
            return out(
                capped.with_knobs(name, **{knob: value}),
                RESTORE,
                f"lasting slack: {name} {label} -> {value}",
                who=name,
                admission_only=knob == "max_waiting",
            )
        home = cfg.budget_home
        if home is not None and b < home and r.raise_slack:
            # Half the step pressure gets: this is probing, not a response to pressure. A budget lowered
            # for TBT was too large for this traffic not long ago; big steps back would re-violate it.
            # At least one tile: +25% of a small budget would round back down to it and never climb.
            nb = cfg.clamp_budget(min(home, r.raise_limit, max(b * (1 + cfg.max_grow / 2), b + cfg.align)))
            if nb > b:
                return out(
                    replace(capped, token_budget=nb),
                    RAISE,
                    f"lasting slack: budget {b} -> {nb} (toward spec {home})",
                    direction=1,
                )
        fewer = settings.replicas - 1
        # Capacity as it would be with one replica fewer: the same decodes on fewer engines leave less of
        # each budget for prefill (judging by today's per-replica capacity would flip-flop with scale-out).
        cap_fewer = prefill_capacity(model, b, r.n_decode * settings.replicas / max(fewer, 1), r.context)
        if fewer >= max(cfg.replicas_min, 1) and r.demand < 0.5 * cap_fewer * fewer:
            return out(
                replace(capped, replicas=fewer),
                SCALE_IN,
                f"lasting slack: replicas {settings.replicas} -> {fewer}",
            )

    if capped != settings:
        return out(capped, CAP, f"chunk caps kept within the budget {b}")
    if r.tbt_worst is None and r.pressure is None and not r.demand:
        return out(settings, HOLD, "no traffic")
    return out(settings, HOLD, "SLOs met")
