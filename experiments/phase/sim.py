"""Adaptive budget vs every static budget on a phase-shifting workload, in the simulator.

    python -m experiments.phase.sim --cost-model cost_model.json --out DIR [--seeds 0,1,2,3,4]

The simulator (stallfree.bench) runs the REAL scheduler on a clock advanced by a profiled cost model. The
workload shifts between phases given as chat (ShareGPT lengths) and summarization (arXiv lengths) arrival
rates, both CPU-scaled; the default alternates interactive traffic (chat + some documents) with a document
batch. Every static budget in --budgets runs the same workload with chunk caps equal to the budget (what
serving stacks do today); the adaptive run starts at --initial and lets the decision core
(stallfree.operator.controller.decide) retune budget, chunk caps and admission every --interval simulated
seconds from windowed P99s, as the live loop does. Writes results.json and phase_shift.png; prints a table.

Goodput = requests per second that met their cluster's SLOs (P99 TTFT and P99 TBT per request). The oracle
picks the best static budget separately for each phase.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from stallfree.costmodel.calibrate import OnlineCostModel
from stallfree.costmodel.model import ProfiledCostModel
from stallfree.operator.controller.config import raise_memory
from stallfree.operator.controller.decide import decide, initial_settings
from stallfree.operator.controller.types import (
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Knobs,
    Settings,
    Slo,
    Snapshot,
    State,
)


@dataclass(frozen=True, slots=True)
class Req:
    index: int
    cluster: str
    prompt: int
    output: int
    arrival: float


def parse_phases(text: str) -> list[tuple[float, float]]:
    """`"0.3/0.02,0/0.3"` -> [(chat QPS, summarization QPS) per phase]; clear errors for anything else."""
    phases = []
    for part in text.split(","):
        try:
            chat, summ = (float(x) for x in part.split("/"))
        except ValueError:
            raise ValueError(f"phase {part!r}: expected CHAT_QPS/SUMM_QPS, e.g. 0.3/0.02") from None
        if chat < 0 or summ < 0 or chat + summ <= 0:
            raise ValueError(f"phase {part!r}: rates must be >= 0 and not both 0")
        phases.append((chat, summ))
    return phases


def build_workload(
    phase_s: float, phases: list[tuple[float, float]], scale: tuple[float, float], seed: int
) -> tuple[list[Req], list[float]]:
    """Poisson chat (ShareGPT lengths) and summarization (arXiv lengths) arrivals at each phase's rates.
    Returns the requests and the phase start times. `scale` is the CPU length scaling for (chat, summ)."""
    from stallfree.bench.traces import load_trace, scale_and_clip

    chat_t = load_trace("sharegpt")
    summ_t = load_trace("arxiv")
    rng = np.random.default_rng(seed)
    reqs: list[Req] = []
    starts = [i * phase_s for i in range(len(phases))]

    def add(trace, name: str, qps: float, t0: float, t1: float, max_out: int, scale: float) -> None:
        if qps <= 0:
            return
        t = t0 + rng.exponential(1 / qps)
        while t < t1:
            i = int(rng.integers(len(trace)))
            p, o, _ = scale_and_clip(
                trace.prompt_tokens[i : i + 1], trace.output_tokens[i : i + 1], scale, 4096
            )
            reqs.append(Req(len(reqs), name, int(p[0]), int(min(o[0], max_out)), float(t)))
            t += rng.exponential(1 / qps)

    for (chat_qps, summ_qps), t0 in zip(phases, starts, strict=True):
        add(chat_t, "chat", chat_qps, t0, t0 + phase_s, 64, scale[0])
        add(summ_t, "summarization", summ_qps, t0, t0 + phase_s, 16, scale[1])
    reqs.sort(key=lambda r: r.arrival)
    return [replace(r, index=i) for i, r in enumerate(reqs)], starts


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """The simulated replica's size: running requests and KV-cache blocks of 16 tokens (the default: the
    CPU server's 1 GiB of SmolLM2-135M KV)."""

    max_num_seqs: int = 64
    kv_blocks: int = 1456


@dataclass(slots=True)
class Rec:
    req: Req
    first_token: float | None = None
    scheduled: float | None = None
    tokens: list[float] = field(default_factory=list)  # sample times, one per output token
    done: bool = False
    rejected: bool = False  # refused at admission (maxWaiting), as the server's 429


def run(
    reqs: list[Req],
    fit,
    specs,
    cfg: ControllerConfig,
    budget: int,
    adaptive: bool,
    interval: float,
    window: float,
    horizon: float,
    static_max_waiting: dict[str, int] | None = None,
    time_target: float | None = None,
    shape: ReplicaShape | None = None,
):
    """One simulated replica; returns records and the controller's timeline. A static run may bound
    clusters' waiting queues (`static_max_waiting`, cluster -> maxWaiting): a hand-set admission limit.
    With `time_target`, iterations are budgeted in time (the engine's default): `budget` is the cap in
    tokens, the clusters' SLOs set each iteration's time, and the scheduler predicts with the engine's
    calibrated cost model, the profile as its prior, refitted from the simulated iteration times. Adaptive
    with `time_target` (and `cfg.time_target` set): the controller's time mode tunes the target, admission
    and replicas; the cap stays."""
    from stallfree.costmodel.features import iteration_features
    from stallfree.engine.block_manager import BlockManager
    from stallfree.engine.config import SchedulerConfig, SchedulerTunables, TrafficClusterLimits
    from stallfree.engine.request import Request, RequestStatus
    from stallfree.engine.sampling_params import SamplingParams
    from stallfree.engine.scheduler import Scheduler

    model = ProfiledCostModel(fit)
    settings = initial_settings(specs, cfg, budget, 1)
    if not adaptive:  # today's stacks: one budget, chunk caps no tighter than it
        bounds = static_max_waiting or {}
        cap = None if time_target is not None else budget  # time-budgeted: no cap besides the budget
        settings = Settings(budget, 1, {s.name: Knobs(cap, bounds.get(s.name), None) for s in specs})

    def tunables(s: Settings) -> SchedulerTunables:
        return SchedulerTunables(
            token_budget=s.token_budget,
            clusters=tuple(
                TrafficClusterLimits(
                    sp.name,
                    s.knobs(sp.name).chunk_cap,
                    s.knobs(sp.name).max_running,
                    sp.priority,
                    tbt_slo=sp.slo.tbt_p99,
                    ttft_slo=sp.slo.ttft_p99,
                )
                for sp in specs
            ),
            time_target=s.time_target if adaptive else time_target,
        )

    predictor = OnlineCostModel(fit.coefficients, gemm_knee=fit.gemm_knee)
    shape = shape or ReplicaShape()
    sched = Scheduler(
        SchedulerConfig(
            policy="sarathi", max_num_seqs=shape.max_num_seqs, max_model_len=4096, tunables=tunables(settings)
        ),
        BlockManager(shape.kv_blocks, 16),
        predictor if time_target is not None else None,
    )
    recs = {r.index: Rec(r, tokens=[]) for r in reqs}
    pending = deque(reqs)
    clock, next_ctl, state, last_change = 0.0, interval, State(), 0.0
    prev_waiting: dict[str, float] = {}
    timeline = []
    while (pending or sched.has_unfinished()) and clock < horizon:
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            bound = settings.knobs(r.cluster).max_waiting
            if bound is not None and sched.count_by_cluster(sched.waiting).get(r.cluster, 0) >= bound:
                recs[r.index].rejected = True  # the server's 429: shedding costs requests here too
                continue
            sched.add_request(Request(request_id=str(r.index), prompt_token_ids=[1] * r.prompt,
                                      sampling_params=SamplingParams(max_tokens=r.output, ignore_eos=True),
                                      arrival_time=r.arrival, traffic_cluster=r.cluster,
                                      priority=next(s.priority for s in specs if s.name == r.cluster)))  # fmt: skip
        if clock >= next_ctl:
            # As the live loop: judge only samples taken under the settings in force (at least 5 s).
            win = max(5.0, min(window, clock - last_change))
            snap = snapshot(recs, sched, specs, clock, win, prev_waiting, interval)
            if time_target is not None:  # what the engine exports: its cost model's P95 error
                err = predictor.error()
                snap = replace(snap, cost_model_error=None if err is None else err.p95)
            point = {"t": clock, "budget": settings.token_budget,
                     "tbt_p99": {sp.name: snap.cluster(sp.name).tbt_p99 for sp in specs}}  # fmt: skip
            if settings.time_target is not None:
                point["time_target"] = settings.time_target
            if adaptive:
                d = decide(snap, settings, state, specs, cfg, model)
                if d.settings != settings:
                    last_change = clock
                settings, state = d.settings, d.state
                sched.tunables = tunables(settings)
                point.update(budget=settings.token_budget, action=d.action, reason=d.reason)
                if settings.time_target is not None:
                    point["time_target"] = settings.time_target
            timeline.append(point)
            next_ctl += interval
        if not sched.has_unfinished():
            clock = min(pending[0].arrival, next_ctl) if pending else clock
            continue
        out = sched.schedule()
        if out.is_empty:
            clock = min(pending[0].arrival if pending else horizon, next_ctl)
            continue
        for c in out.chunks:
            rec = recs[int(c.request_id)]
            if rec.scheduled is None:
                rec.scheduled = clock
        features = iteration_features(out.chunks)
        dt = fit.predict(features)
        clock += dt
        if time_target is not None:
            predictor.observe(features, dt)
        for c in out.chunks:
            if not c.sample:
                continue
            req = sched.get(c.request_id)
            rec = recs[int(c.request_id)]
            req.output_token_ids.append(1)
            rec.tokens.append(clock)
            if rec.first_token is None:
                rec.first_token = clock
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                sched.finish_request(c.request_id, RequestStatus.FINISHED_LENGTH)
                rec.done = True
    return list(recs.values()), timeline


def snapshot(
    recs: dict, sched, specs, now: float, window: float, prev_waiting: dict[str, float], dt: float
) -> Snapshot:
    """What the Prometheus queries would return for the window ending at `now`. `prev_waiting` holds the
    queue lengths one interval (`dt` seconds) ago, for the queue trend; it is updated in place."""
    lo = now - window
    clusters = {}
    waiting = sched.count_by_cluster(sched.waiting) if hasattr(sched, "waiting") else {}
    running = sched.count_by_cluster(sched.running) if hasattr(sched, "running") else {}
    for sp in specs:
        mine = [r for r in recs.values() if r.req.cluster == sp.name]
        gaps = [b - a for r in mine for a, b in zip(r.tokens, r.tokens[1:], strict=False) if b >= lo]
        ttfts = [
            r.first_token - r.req.arrival for r in mine if r.first_token is not None and r.first_token >= lo
        ]
        delays = [r.scheduled - r.req.arrival for r in mine if r.scheduled is not None and r.scheduled >= lo]
        arrived = [r for r in mine if lo <= r.req.arrival <= now]
        clusters[sp.name] = ClusterSnapshot(
            name=sp.name,
            tbt_p99=float(np.percentile(gaps, 99)) if gaps else None,
            ttft_p99=float(np.percentile(ttfts, 99)) if ttfts else None,
            scheduling_delay_p50=float(np.percentile(delays, 50)) if delays else None,
            waiting=float(waiting.get(sp.name, 0)),
            waiting_trend=(waiting.get(sp.name, 0) - prev_waiting.get(sp.name, 0)) / dt,
            running=float(running.get(sp.name, 0)),
            arrival_rate=len(arrived) / window,
            prefill_token_rate=sum(r.req.prompt for r in arrived) / window,
            rejection_rate=sum(r.rejected for r in arrived) / window,  # the server's 429 counter
            mean_context=float(np.mean([r.req.prompt for r in arrived])) if arrived else 0.0,
        )
    prev_waiting.update({sp.name: float(waiting.get(sp.name, 0)) for sp in specs})
    return Snapshot(time=now, clusters=clusters)


def meets(rec: Rec, slo: Slo) -> bool:
    if not rec.done or rec.first_token is None or rec.first_token - rec.req.arrival > slo.ttft_p99:
        return False
    gaps = [b - a for a, b in zip(rec.tokens, rec.tokens[1:], strict=False)]
    return not gaps or float(np.percentile(gaps, 99)) <= slo.tbt_p99


def score(recs: list[Rec], specs, starts: list[float], phase_s: float) -> dict:
    slo = {s.name: s.slo for s in specs}
    per_phase = []
    for t0 in starts:
        mine = [r for r in recs if t0 <= r.req.arrival < t0 + phase_s]
        phase_good = sum(meets(r, slo[r.req.cluster]) for r in mine)
        per_phase.append({"requests": len(mine), "good": phase_good, "goodput": phase_good / phase_s})
    good = sum(p["good"] for p in per_phase)
    total = sum(p["requests"] for p in per_phase)
    return {
        "goodput": good / (phase_s * len(starts)),
        "attainment": good / max(total, 1),
        "phases": per_phase,
    }


def gap_closed(value: float, base: float, ceiling: float) -> float | None:
    """(value - base) / (ceiling - base): the share of the room above `base` that `value` takes; None
    when there is no room."""
    return None if ceiling - base <= 1e-12 else (value - base) / (ceiling - base)


def cluster_figures(recs: Sequence[Rec], specs) -> dict:
    """Per cluster: the P99 of every gap between tokens, the share of requests within their TBT SLO, and
    the median and P99 TTFT (requests that got a first token)."""
    out = {}
    for sp in specs:
        mine = [r for r in recs if r.req.cluster == sp.name]
        gaps = [b - a for r in mine for a, b in zip(r.tokens, r.tokens[1:], strict=False)]
        ttfts = [r.first_token - r.req.arrival for r in mine if r.first_token is not None]
        own = [float(np.percentile(np.diff(r.tokens), 99)) for r in mine if len(r.tokens) > 1]
        out[sp.name] = {
            "requests": len(mine),
            "tbt_p99_s": float(np.percentile(gaps, 99)) if gaps else None,
            "tbt_met": sum(v <= sp.slo.tbt_p99 for v in own) / len(own) if own else None,
            "ttft_p50_s": float(np.median(ttfts)) if ttfts else None,
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
        }
    return out


def client_timeline(recs: Sequence[Rec], names: Sequence[str], step: float, window: float) -> list[dict]:
    """Each cluster's P99 of the inter-token gaps that ended in the last `window` seconds, every `step`
    seconds, as the client saw them (the same points for static and adaptive runs)."""
    ends: dict[str, list[float]] = {n: [] for n in names}
    gaps: dict[str, list[float]] = {n: [] for n in names}
    for r in recs:
        ends[r.req.cluster] += r.tokens[1:]
        gaps[r.req.cluster] += np.diff(r.tokens).tolist() if len(r.tokens) > 1 else []
    last = max((t for v in ends.values() for t in v), default=0.0)
    e = {n: np.asarray(v) for n, v in ends.items()}
    g = {n: np.asarray(v) for n, v in gaps.items()}
    out = []
    for t in np.arange(step, last + step, step):
        p99: dict[str, float | None] = {}
        for n in names:
            sel = g[n][(e[n] > t - window) & (e[n] <= t)]
            p99[n] = float(np.percentile(sel, 99)) if len(sel) else None
        out.append({"t": float(t), "tbt_p99": p99})
    return out


def recovery_intervals(timeline: list[dict], starts: list[float], specs, interval: float) -> list[int | None]:
    """Per phase change: control intervals from the change until every cluster's windowed P99 TBT is
    within its SLO again, after the first violation the change caused (0 = no violation in that phase,
    None = still violated at the next phase change)."""
    slo = {s.name: s.slo.tbt_p99 for s in specs}
    out: list[int | None] = []
    for t0, t1 in zip(starts[1:], [*starts[2:], float("inf")], strict=True):
        after = [x for x in timeline if t0 < x["t"] <= t1]
        ok = [all(v is None or v <= slo[n] for n, v in x["tbt_p99"].items()) for x in after]
        bad = next((i for i, good in enumerate(ok) if not good), None)
        if bad is None:
            out.append(0)
            continue
        back = next((i for i in range(bad + 1, len(ok)) if ok[i]), None)
        out.append(None if back is None else math.ceil((after[back]["t"] - t0) / interval - 1e-9))
    return out


def violation_episodes(timeline: list[dict], specs, interval: float) -> list[dict]:
    """Every stretch of the timeline in which some cluster's P99 TBT is over its SLO, wherever it falls:
    {start, intervals (control intervals from its first violated point to the first point with every
    cluster within SLO again; None = still over at the end), worst (the largest P99 TBT / SLO in it)}.
    recovery_intervals counts from each phase change; this counts from each violation's own start, so a
    violation in mid-phase (the controller's own move, or drift) is measured by how long it lasted."""
    slo = {s.name: s.slo.tbt_p99 for s in specs}
    out: list[dict] = []
    open_: dict | None = None
    for x in timeline:
        ratios = [v / slo[n] for n, v in x["tbt_p99"].items() if v is not None]
        worst = max(ratios, default=0.0)
        if worst > 1.0:
            if open_ is None:
                open_ = {"start": float(x["t"]), "intervals": None, "worst": worst}
                out.append(open_)
            open_["worst"] = max(open_["worst"], worst)
        elif open_ is not None:
            open_["intervals"] = math.ceil((x["t"] - open_["start"]) / interval - 1e-9)
            open_ = None
    return out


def longest_episode(episodes: list[dict]) -> int | None:
    """The longest violation in control intervals: 0 with none, None when one never ended."""
    lengths = [e["intervals"] for e in episodes]
    return None if None in lengths else max(lengths, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.phase.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cost-model", required=True, help="cost_model.json from `stallfree profile`")
    p.add_argument("--out", required=True, help="folder for results.json and phase_shift.png")
    p.add_argument("--phase-seconds", type=float, default=300.0)
    p.add_argument(
        "--phases",
        default="0.6/0.1,0/0.55,0.6/0.1,0/0.55",
        help="CHAT_QPS/SUMM_QPS per phase, comma-separated (default: interactive, document batch, x2)",
    )
    p.add_argument("--chat-scale", type=float, default=0.05, help="CPU scaling of ShareGPT lengths")
    p.add_argument("--summ-scale", type=float, default=0.25, help="CPU scaling of arXiv lengths")
    p.add_argument("--chat-tbt-slo", type=float, default=0.8)
    p.add_argument("--chat-ttft-slo", type=float, default=20.0)
    p.add_argument("--summ-tbt-slo", type=float, default=5.0)
    p.add_argument("--summ-ttft-slo", type=float, default=30.0)
    p.add_argument("--budgets", default="128,256,384,512,768,1024,1536,2048")
    p.add_argument("--initial", type=int, default=512)
    p.add_argument("--time-target", type=float, default=0.8,
                   help="the time-budgeted run's target (share of the strictest decoding cluster's P99 TBT SLO)")  # fmt: skip
    p.add_argument("--time-cap", type=int, default=2048, help="the time-budgeted run's cap in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once in the replica")
    p.add_argument("--kv-blocks", type=int, default=1456,
                   help="KV-cache blocks of 16 tokens (default: the CPU server's 1 GiB for SmolLM2-135M)")  # fmt: skip
    p.add_argument("--interval", type=float, default=10.0, help="control interval, simulated seconds")
    p.add_argument("--window", type=float, default=30.0, help="longest metrics window, simulated seconds")
    p.add_argument("--seeds", default="0", help="comma list of workload seeds; medians are reported")
    p.add_argument("--static-queue-bounds", default="", metavar="N,N,...",
                   help="ablation: also run every static budget with the lowest-priority cluster's waiting "
                   "queue bounded at each N (a hand-set maxWaiting), and report adaptive against the best of "
                   "those too (default: none)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        a.static_queue_bounds = [int(x) for x in a.static_queue_bounds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--static-queue-bounds: expected comma-separated integers, got {a.static_queue_bounds!r}")
    if any(w < 1 for w in a.static_queue_bounds):
        p.error("--static-queue-bounds: every bound must be >= 1")
    from stallfree.costmodel.fitted import FittedCostModel

    try:
        phases = parse_phases(a.phases)
    except ValueError as e:
        p.error(f"--phases: {e}")
    fit = FittedCostModel.load(a.cost_model)
    specs = (
        ClusterSpec("chat", Slo(a.chat_ttft_slo, a.chat_tbt_slo, a.chat_ttft_slo), priority=10),
        ClusterSpec("summarization", Slo(a.summ_ttft_slo, a.summ_tbt_slo, a.summ_ttft_slo), priority=0),
    )
    budgets = [int(b) for b in a.budgets.split(",")]
    cfg = ControllerConfig(budget_min=min(budgets), budget_max=max(budgets), align=32, interval_s=a.interval,
                           budget_home=a.initial, scale_in_after=3,
                           raise_memory=raise_memory(a.window, a.interval))  # fmt: skip
    seeds = [int(x) for x in str(a.seeds).split(",")]
    runs = [one_seed(a, seed, phases, fit, specs, cfg, budgets) for seed in seeds]
    results = runs[0]  # the first seed's full record is the one plotted
    summaries = [r["summary"] for r in runs]
    med = {
        k: float(np.median([s[k] for s in summaries]))
        for k in (
            "adaptive_vs_best_static",
            "adaptive_vs_oracle",
            "oracle_vs_best_static",
            "ceiling_vs_best_static",
            "time_budget_vs_best_static",
            "time_controlled_vs_best_static",
            "adaptive_vs_best_bounded_static",
        )
        if all(k in s for s in summaries)
    }
    recov = [x for s in summaries for x in s["recovery_intervals"]]
    recov_iv = [x for s in summaries for x in s["interval_recovery_intervals"]]
    results["seeds"] = {
        "seeds": seeds,
        "per_seed": [{"seed": sd, **s} for sd, s in zip(seeds, summaries, strict=True)],
        "median": med,
        "recovery_intervals_all": recov,
        "worst_recovery": None if None in recov else max(recov, default=0),
        "interval_recovery_intervals_all": recov_iv,
        "recovered_within_3": {
            "window": sum(x is not None and x <= 3 for x in recov),
            "per_interval": sum(x is not None and x <= 3 for x in recov_iv),
            "of": len(recov),
        },
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    n = len(seeds)
    plot(results, budgets, results["starts"], phases, specs, a.phase_seconds, out / "phase_shift.png",
         title=f"workload seed {results['seed']} (of {n})")  # fmt: skip
    for sd, s in zip(seeds, summaries, strict=True):
        print(f"seed {sd}: adaptive {s['adaptive_goodput']:.3f} req/s; best static {s['best_static_budget']}: "
              f"{s['best_static_goodput']:.3f}; oracle {s['oracle_goodput']:.3f} (budgets {s['oracle_budgets']}); "
              f"adaptive/best static {s['adaptive_vs_best_static']:.2f}x, adaptive/oracle "
              f"{s['adaptive_vs_oracle']:.2f}x, ceiling/best static {s['ceiling_vs_best_static']:.2f}x; recovery intervals {s['recovery_intervals']} (controller's "
              f"window), {s['interval_recovery_intervals']} (each interval's own P99); longest violation "
              f"{s['longest_violation_intervals']} intervals (window), {s['interval_longest_violation_intervals']} "
              f"(own P99)")  # fmt: skip
    w3 = results["seeds"]["recovered_within_3"]
    print(f"median over {len(seeds)} seed(s): adaptive/best static {med['adaptive_vs_best_static']:.2f}x, "
          f"adaptive/oracle {med['adaptive_vs_oracle']:.2f}x (oracle/best static {med['oracle_vs_best_static']:.2f}x, "
          f"every request good/best static {med['ceiling_vs_best_static']:.2f}x); "
          f"worst recovery {results['seeds']['worst_recovery']} intervals; recovered within 3 intervals: "
          f"{w3['window']} of {w3['of']} phase changes (window), {w3['per_interval']} (per interval)")  # fmt: skip
    closed = [s["time_budget_gap_closed"] for s in summaries if s["time_budget_gap_closed"] is not None]
    print(f"time-budgeted: {med['time_budget_vs_best_static']:.2f}x the best static budget (median; per seed "
          f"{[round(s['time_budget_vs_best_static'], 3) for s in summaries]}), closing "
          f"{[round(c, 2) for c in closed]} of the distance to every request good")  # fmt: skip
    print(f"time-budgeted + controller: {med['time_controlled_vs_best_static']:.2f}x the best static budget "
          f"(median; per seed {[round(s['time_controlled_vs_best_static'], 3) for s in summaries]})")  # fmt: skip
    for sd, s in zip(seeds, summaries, strict=True):
        t, b = s["time_budget_clusters"], s["best_static_clusters"]
        print(f"seed {sd}: " + "; ".join(
            f"{n}: P99 TBT {t[n]['tbt_p99_s']} vs {b[n]['tbt_p99_s']} s, TTFT P50/P99 "
            f"{t[n]['ttft_p50_s']}/{t[n]['ttft_p99_s']} vs {b[n]['ttft_p50_s']}/{b[n]['ttft_p99_s']} s"
            for n in t) + " (time-budgeted vs best static)")  # fmt: skip
    if "adaptive_vs_best_bounded_static" in med:
        picks = ", ".join(s["best_bounded_static"] for s in summaries)
        print(f"ablation: adaptive/best static budget with a hand-set queue bound "
              f"{med['adaptive_vs_best_bounded_static']:.2f}x (median; best per seed: {picks})")  # fmt: skip
    return 0


def one_seed(a, seed: int, phases, fit, specs, cfg: ControllerConfig, budgets: list[int]) -> dict:
    """Every static budget and the adaptive controller on one seeded workload."""
    reqs, starts = build_workload(a.phase_seconds, phases, (a.chat_scale, a.summ_scale), seed)
    horizon = a.phase_seconds * len(starts) + 1800
    shape = ReplicaShape(a.max_num_seqs, a.kv_blocks)
    results: dict = {"config": vars(a), "seed": seed, "starts": starts, "num_requests": len(reqs),
                     "static": {}, "adaptive": None}  # fmt: skip
    for b in budgets:
        recs, tl = run(reqs, fit, specs, cfg, b, False, a.interval, a.window, horizon, shape=shape)
        sc = score(recs, specs, starts, a.phase_seconds)
        sc["recovery_intervals"] = recovery_intervals(tl, starts, specs, a.interval)
        results["static"][b] = sc
        print(f"seed {seed} static {b:5d}: goodput {sc['goodput']:.3f} req/s, attainment {sc['attainment']:.1%}, "
              f"per phase {[p['good'] for p in sc['phases']]}", file=sys.stderr)  # fmt: skip
    # Ablation: today's stacks with a hand-set queue bound on the lowest-priority cluster, every budget x
    # bound. Not the issue's baseline (a static budget); it shows how much of adaptive's gain an
    # admission limit alone, set in advance for this workload, would have had.
    shed = min(specs, key=lambda s: s.priority).name
    bounded: dict[str, dict] = {}
    for b in budgets:
        for w in a.static_queue_bounds:
            recs, _ = run(
                reqs, fit, specs, cfg, b, False, a.interval, a.window, horizon, {shed: w}, shape=shape
            )
            bounded[f"{b}/w{w}"] = sc = score(recs, specs, starts, a.phase_seconds)
            sc["rejected"] = sum(r.rejected for r in recs)
            print(f"seed {seed} static {b:5d}, {shed} maxWaiting {w}: goodput {sc['goodput']:.3f} req/s, "
                  f"per phase {[p['good'] for p in sc['phases']]}, {sc['rejected']} rejected", file=sys.stderr)  # fmt: skip
    if bounded:
        results["bounded_static"] = bounded
    # The engine's default: iterations budgeted in time from the SLOs of who decodes, no controller.
    recs, _ = run(reqs, fit, specs, cfg, a.time_cap, False, a.interval, a.window, horizon,
                  time_target=a.time_target, shape=shape)  # fmt: skip
    timed = score(recs, specs, starts, a.phase_seconds)
    timed["clusters"] = cluster_figures(recs, specs)
    results["time_budget"] = timed
    print(f"seed {seed} time-budgeted (target {a.time_target:g}, cap {a.time_cap}): goodput "
          f"{timed['goodput']:.3f} req/s, attainment {timed['attainment']:.1%}, per phase "
          f"{[p['good'] for p in timed['phases']]}", file=sys.stderr)  # fmt: skip
    # ... and with the controller's time mode on top (target, admission, replicas; the cap stays)
    cfg_time = replace(cfg, time_target=a.time_target, budget_max=max(cfg.budget_max, a.time_cap))
    recs, ttl = run(reqs, fit, specs, cfg_time, a.time_cap, True, a.interval, a.window, horizon,
                    time_target=a.time_target, shape=shape)  # fmt: skip
    timed_ctl = score(recs, specs, starts, a.phase_seconds)
    timed_ctl["clusters"] = cluster_figures(recs, specs)
    timed_ctl["timeline"] = ttl
    timed_ctl["rejected"] = sum(r.rejected for r in recs)
    results["time_budget_controlled"] = timed_ctl
    print(f"seed {seed} time-budgeted + controller: goodput {timed_ctl['goodput']:.3f} req/s, attainment "
          f"{timed_ctl['attainment']:.1%}, per phase {[p['good'] for p in timed_ctl['phases']]}, "
          f"{timed_ctl['rejected']} rejected", file=sys.stderr)  # fmt: skip
    recs, tl = run(reqs, fit, specs, cfg, a.initial, True, a.interval, a.window, horizon, shape=shape)
    ad = score(recs, specs, starts, a.phase_seconds)
    ad["timeline"] = tl
    ad["recovery_intervals"] = recovery_intervals(tl, starts, specs, a.interval)
    # The same count on each interval's own P99 (gaps that ended in it): when users stopped stalling,
    # without the controller's longer window still holding stalls from before its correction.
    per_interval = client_timeline(recs, [s.name for s in specs], a.interval, a.interval)
    ad["interval_recovery_intervals"] = recovery_intervals(per_interval, starts, specs, a.interval)
    ad["violation_episodes"] = violation_episodes(tl, specs, a.interval)
    ad["interval_violation_episodes"] = violation_episodes(per_interval, specs, a.interval)
    ad["rejected"] = sum(r.rejected for r in recs)
    results["adaptive"] = ad
    best_static = max(budgets, key=lambda b: results["static"][b]["goodput"])
    recs, _ = run(reqs, fit, specs, cfg, best_static, False, a.interval, a.window, horizon, shape=shape)
    results["static"][best_static]["clusters"] = cluster_figures(recs, specs)

    def best_in_phase(i: int) -> int:
        return max(budgets, key=lambda b: results["static"][b]["phases"][i]["good"])

    per_phase_best = [best_in_phase(i) for i in range(len(starts))]
    oracle = sum(results["static"][b]["phases"][i]["good"] for i, b in enumerate(per_phase_best))
    oracle_goodput = oracle / (a.phase_seconds * len(starts))
    # The most any policy can reach: every request good. Where this is under a goodput target, no
    # controller meets it on this workload.
    ceiling_goodput = len(reqs) / (a.phase_seconds * len(starts))
    results["summary"] = {
        "best_static_budget": best_static,
        "best_static_goodput": results["static"][best_static]["goodput"],
        "adaptive_goodput": ad["goodput"],
        "adaptive_attainment": ad["attainment"],
        "oracle_goodput": oracle_goodput,
        "oracle_budgets": per_phase_best,
        "adaptive_vs_best_static": ad["goodput"] / max(results["static"][best_static]["goodput"], 1e-9),
        "adaptive_vs_oracle": ad["goodput"] / max(oracle_goodput, 1e-9),
        "oracle_vs_best_static": oracle_goodput / max(results["static"][best_static]["goodput"], 1e-9),
        "ceiling_goodput": ceiling_goodput,
        "ceiling_vs_best_static": ceiling_goodput / max(results["static"][best_static]["goodput"], 1e-9),
        "time_budget_goodput": timed["goodput"],
        "time_budget_vs_best_static": timed["goodput"] / max(results["static"][best_static]["goodput"], 1e-9),
        # how much of the distance from the best static budget to every request good it closes
        "time_budget_gap_closed": gap_closed(
            timed["goodput"], results["static"][best_static]["goodput"], ceiling_goodput
        ),
        "time_budget_clusters": timed["clusters"],
        "time_controlled_goodput": timed_ctl["goodput"],
        "time_controlled_vs_best_static": timed_ctl["goodput"]
        / max(results["static"][best_static]["goodput"], 1e-9),
        "time_controlled_gap_closed": gap_closed(
            timed_ctl["goodput"], results["static"][best_static]["goodput"], ceiling_goodput
        ),
        "best_static_clusters": results["static"][best_static]["clusters"],
        "recovery_intervals": ad["recovery_intervals"],
        "interval_recovery_intervals": ad["interval_recovery_intervals"],
        "longest_violation_intervals": longest_episode(ad["violation_episodes"]),
        "interval_longest_violation_intervals": longest_episode(ad["interval_violation_episodes"]),
    }
    if bounded:
        best_bounded = max(bounded, key=lambda k: bounded[k]["goodput"])
        results["summary"].update(
            best_bounded_static=best_bounded,
            best_bounded_static_goodput=bounded[best_bounded]["goodput"],
            adaptive_vs_best_bounded_static=ad["goodput"] / max(bounded[best_bounded]["goodput"], 1e-9),
        )
    return results


def plot(
    results: dict,
    budgets: Sequence[int],
    starts: Sequence[float],
    phases: Sequence[tuple[float, float]],
    specs: Sequence[ClusterSpec],
    phase_s: float,
    path: Path,
    *,
    xlabel: str = "simulated seconds",
    title: str | None = None,
) -> None:
    """Left: goodput per static budget with the adaptive and per-phase oracle lines. Right: the adaptive
    budget over time (log scale) with each cluster's windowed P99 TBT / SLO, phases shaded and labelled.
    Shared by the simulated and the live experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1, 1.5]})
    g = [results["static"][b]["goodput"] for b in budgets]
    ax1.bar([str(b) for b in budgets], g, color="#999", label="static budget")
    ax1.axhline(results["adaptive"]["goodput"], color="C3", lw=2, label="adaptive controller")
    if results.get("time_budget"):
        ax1.axhline(
            results["time_budget"]["goodput"], color="C2", lw=2, label="time-budgeted (engine default)"
        )
    ax1.axhline(results["summary"]["oracle_goodput"], color="C0", ls="--", label="per-phase oracle")
    ax1.axhline(results["summary"]["ceiling_goodput"], color="k", ls=":", label="every request good")
    ax1.set_xlabel("static token budget")
    ax1.set_ylabel("goodput (requests/s meeting their SLOs)")
    # Room above the highest line for the legend, so it hides no bar.
    top = max([*g, results["adaptive"]["goodput"], results["summary"]["ceiling_goodput"],
               (results.get("time_budget") or {}).get("goodput", 0.0)])  # fmt: skip
    ax1.set_ylim(0, 1.35 * top)
    ax1.legend(loc="upper center", ncol=2, fontsize=8)
    if title:
        ax1.set_title(title, fontsize=9)
    tl = results["adaptive"]["timeline"]
    ts = [x["t"] for x in tl]
    ax2.step(ts, [x["budget"] for x in tl], where="post", color="C3", lw=2, label="adaptive budget")
    for t0, (chat, summ) in zip(starts, phases, strict=True):
        ax2.axvspan(t0, t0 + phase_s, color="C1" if chat == 0 else "C2", alpha=0.12)
        ax2.text(t0 + phase_s / 2, 0.98, f"chat {chat:g}/s\nsumm {summ:g}/s", ha="center", va="top",
                 transform=ax2.get_xaxis_transform(), fontsize=8)  # fmt: skip
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("token budget")
    ax2b = ax2.twinx()
    for i, sp in enumerate(specs):
        v = [x["tbt_p99"].get(sp.name) for x in tl]
        ratio = [np.nan if x is None else x / sp.slo.tbt_p99 for x in v]
        ax2b.plot(ts, ratio, color=f"C{i}", lw=0.8, label=f"{sp.name} P99 TBT / SLO")
    ax2b.axhline(1.0, color="k", ls=":", lw=0.8)
    ax2b.set_ylabel("windowed P99 TBT / SLO")
    ax2b.set_ylim(0, 3)
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax2b.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
