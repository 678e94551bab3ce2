"""How far a knob moves: the cost-model arithmetic the rules share.

Plain functions of the interval's `Reading` and the settings in force: the budget a raise goes to, the
running cap and queue bound the cost model allows, the capacity left with one replica fewer, and chunk caps
that follow the budget. With a model trusted only for its shape, the one-step sizes fall back to halving.
"""

from __future__ import annotations

from collections.abc import Sequence

from stallfree.costmodel.planning import budget_for_demand, prefill_capacity
from stallfree.operator.controller.reading import Reading
from stallfree.operator.controller.types import ClusterSpec, Settings


def with_caps(settings: Settings, specs: Sequence[ClusterSpec], budget: int) -> Settings:
    """Chunk caps follow the budget: the spec's cap (the user's ceiling) but never above the budget."""
    out = settings
    for s in specs:
        cap = min(s.knobs.chunk_cap or budget, budget)
        if out.knobs(s.name).chunk_cap != cap:
            out = out.with_knobs(s.name, chunk_cap=cap)
    return out


def raise_budget(r: Reading, settings: Settings) -> int:
    """The budget a raise under pressure goes to: +`max_grow` (at least a tile), or under modelled overload
    straight to the budget the cost model says serves the arrivals; never past the calibrated limit."""
    cfg, b = r.cfg, settings.token_budget
    step = max(b * (1 + cfg.max_grow), b + cfg.align)
    if r.overloaded:  # the cost model says how far: straight to a budget that serves the demand
        need = budget_for_demand(
            r.model, r.demand / (cfg.overload * settings.replicas), r.n_decode, r.context,
            cfg.budget_min, cfg.budget_max, cfg.align,
        )  # fmt: skip
        step = max(step, need)
    return cfg.clamp_budget(min(r.raise_limit, step))


def probe_budget(r: Reading, settings: Settings, home: int) -> int:
    """The budget a probe back toward `home` goes to: half the step pressure gets (a budget lowered for
    TBT was too large for this traffic not long ago; big steps back would re-violate it), at least one
    tile (+25% of a small budget would round back down to it and never climb), within the calibrated
    limit."""
    cfg, b = r.cfg, settings.token_budget
    return cfg.clamp_budget(min(home, r.raise_limit, max(b * (1 + cfg.max_grow / 2), b + cfg.align)))


def running_cap_within_target(r: Reading, settings: Settings, name: str, half: int, budget: int) -> int:
    """A running cap for `name` in one step: with a model trusted in absolute terms, the largest up to
    `half` with which a full iteration at `budget` meets the TBT target (at least 1); else `half`."""
    if not r.absolute:
        return half
    c, reps = r.snap.cluster(name), max(settings.replicas, 1)
    others = max(r.n_decode - c.running / reps, 0.0)
    for k in range(half, 1, -1):
        n2 = others + k
        ctx = (r.context * r.n_decode - c.mean_context * c.running / reps + c.mean_context * k) / n2
        if r.model.iteration_time(max(budget - n2, 0.0), n2, max(ctx, 0.0)) <= r.time_limit:
            return k
    return 1


def admits(r: Reading, settings: Settings, name: str, max_running: int) -> bool:
    """Whether the calibrated cost model keeps TBT within target with `name` running up to `max_running`
    per replica (from its queue) on top of what runs now."""
    c, reps = r.snap.cluster(name), max(settings.replicas, 1)
    extra = max(0.0, min(max_running - c.running / reps, c.waiting / reps))
    n2 = r.n_decode + extra
    ctx = (r.context * r.n_decode + c.mean_context * extra) / n2 if n2 else 0.0
    b = r.budget
    return r.model.iteration_time(max(b - n2, 0.0), n2, ctx) <= r.time_limit


def admitted_running_cap(r: Reading, settings: Settings, name: str, want: int) -> int | None:
    """The largest running cap for `name`, doubling from today's up to `want`, that `admits`; None when
    not even one doubling does."""
    now = settings.knobs(name).max_running or want
    best, v = None, now
    while v < want:
        v = min(want, v * 2)
        if not admits(r, settings, name, v):
            break
        best = v
    return best


def drain_bound(r: Reading, settings: Settings, name: str, budget: int | None = None) -> int | None:
    """With a model trusted in absolute terms: the queue of `name` that its share of the modelled prefill
    capacity at `budget` (the current one by default; what higher-priority clusters leave) serves within
    `target` x its TTFT SLO. A longer queue only holds requests that will miss it. None without such a
    model or arrivals."""
    c = r.snap.cluster(name)
    if not r.absolute or c.arrival_rate <= 0 or c.prefill_token_rate <= 0:
        return None
    spec = next(s for s in r.specs if s.name == name)
    above = sum(r.snap.cluster(s.name).prefill_token_rate for s in r.specs if s.priority > spec.priority)
    capacity = r.capacity if budget is None else prefill_capacity(r.model, budget, r.n_decode, r.context)
    share = capacity - above / max(settings.replicas, 1)
    mean_prompt = c.prefill_token_rate / c.arrival_rate
    if mean_prompt < 1:  # less than a token a request: no meaningful rate yet
        return None
    return int(max(share, 0.0) * r.cfg.target * spec.slo.ttft_p99 / mean_prompt) - 1


def fits_one_replica_fewer(r: Reading, settings: Settings) -> bool:
    """Whether prefill demand is under half of what one replica fewer serves (and one fewer is allowed).
    Capacity is taken as it would be then: the same decodes on fewer engines leave less of each budget for
    prefill (judging by today's per-replica capacity would flip-flop with scale-out)."""
    fewer = settings.replicas - 1
    cap_fewer = prefill_capacity(r.model, r.budget, r.n_decode * settings.replicas / max(fewer, 1), r.context)
    return fewer >= max(r.cfg.replicas_min, 1) and r.demand < 0.5 * cap_fewer * fewer
