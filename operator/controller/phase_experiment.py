"""Adaptive budget vs every static budget on a phase-shifting workload, in the simulator.

    python -m stallfree.operator.controller.phase_experiment --cost-model cost_model.json --out DIR

The simulator (stallfree.bench) runs the REAL scheduler on a clock advanced by a profiled cost model. The
workload shifts between chat (ShareGPT lengths) alone and chat plus long-prompt summarization (arXiv
lengths), both CPU-scaled. Every static budget in --budgets runs the same workload with chunk caps equal to
the budget (what serving stacks do today); the adaptive run starts at --initial and lets the decision core
(stallfree.operator.controller.decide) retune budget and chunk caps every --interval simulated seconds from
windowed P99s, exactly as the live loop does. Writes results.json and phase_shift.png; prints a table.

Goodput = requests per second that met their cluster's SLOs (P99 TTFT and P99 TBT per request). The oracle
picks the best static budget separately for each phase.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from stallfree.operator.controller.cost_model import ProfiledCostModel
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


def build_workload(
    phase_s: float, chat_qps: float, summ_qps: float, scale: tuple[float, float], seed: int
) -> tuple[list[Req], list[float]]:
    """Phases: chat | chat+summarization | chat | chat+summarization. Returns requests and phase starts.
    `scale` is the CPU length scaling for (chat, summarization)."""
    from stallfree.bench.traces import load_trace, scale_and_clip

    chat_t = load_trace("sharegpt")
    summ_t = load_trace("arxiv")
    rng = np.random.default_rng(seed)
    reqs: list[Req] = []
    starts = [i * phase_s for i in range(4)]

    def add(trace, name: str, qps: float, t0: float, t1: float, max_out: int, scale: float) -> None:
        t = t0 + rng.exponential(1 / qps)
        while t < t1:
            i = int(rng.integers(len(trace)))
            p, o, _ = scale_and_clip(
                trace.prompt_tokens[i : i + 1], trace.output_tokens[i : i + 1], scale, 4096
            )
            reqs.append(Req(len(reqs), name, int(p[0]), int(min(o[0], max_out)), float(t)))
            t += rng.exponential(1 / qps)

    for k, t0 in enumerate(starts):
        add(chat_t, "chat", chat_qps, t0, t0 + phase_s, 64, scale[0])
        if k % 2 == 1:
            add(summ_t, "summarization", summ_qps, t0, t0 + phase_s, 16, scale[1])
    reqs.sort(key=lambda r: r.arrival)
    return [replace(r, index=i) for i, r in enumerate(reqs)], starts


@dataclass(slots=True)
class Rec:
    req: Req
    first_token: float | None = None
    scheduled: float | None = None
    tokens: list[float] = field(default_factory=list)  # sample times, one per output token
    done: bool = False


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
):
    """One simulated replica; returns records and the controller's timeline."""
    from stallfree.bench.costmodel import iteration_features
    from stallfree.bench.simulator import DEFAULT_KV_BLOCKS
    from stallfree.engine.block_manager import BlockManager
    from stallfree.engine.config import SchedulerConfig, SchedulerTunables, TrafficClusterLimits
    from stallfree.engine.request import Request, RequestStatus
    from stallfree.engine.sampling_params import SamplingParams
    from stallfree.engine.scheduler import Scheduler

    model = ProfiledCostModel(fit)
    settings = initial_settings(specs, cfg, budget, 1)
    if not adaptive:  # today's stacks: one budget, chunk caps no tighter than it
        settings = Settings(budget, 1, {s.name: Knobs(budget, None, None) for s in specs})

    def tunables(s: Settings) -> SchedulerTunables:
        return SchedulerTunables(
            token_budget=s.token_budget,
            clusters=tuple(
                TrafficClusterLimits(sp.name, s.knobs(sp.name).chunk_cap, None, sp.priority) for sp in specs
            ),
        )

    sched = Scheduler(
        SchedulerConfig(policy="sarathi", max_num_seqs=64, max_model_len=4096, tunables=tunables(settings)),
        BlockManager(DEFAULT_KV_BLOCKS, 16),
    )
    recs = {r.index: Rec(r, tokens=[]) for r in reqs}
    pending = deque(reqs)
    clock, next_ctl, state = 0.0, interval, State()
    timeline = []
    while (pending or sched.has_unfinished()) and clock < horizon:
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            sched.add_request(Request(request_id=str(r.index), prompt_token_ids=[1] * r.prompt,
                                      sampling_params=SamplingParams(max_tokens=r.output, ignore_eos=True),
                                      arrival_time=r.arrival, traffic_cluster=r.cluster,
                                      priority=next(s.priority for s in specs if s.name == r.cluster)))  # fmt: skip
        if clock >= next_ctl:
            if adaptive:
                snap = snapshot(recs, sched, specs, clock, window)
                d = decide(snap, settings, state, specs, cfg, model)
                settings, state = d.settings, d.state
                sched.tunables = tunables(settings)
                timeline.append({"t": clock, "budget": settings.token_budget, "action": d.action, "reason": d.reason,
                                 "chat_tbt_p99": snap.cluster("chat").tbt_p99})  # fmt: skip
            else:
                timeline.append({"t": clock, "budget": settings.token_budget})
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
        clock += fit.predict(iteration_features(out.chunks))
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


def snapshot(recs: dict, sched, specs, now: float, window: float) -> Snapshot:
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
            running=float(running.get(sp.name, 0)),
            arrival_rate=len(arrived) / window,
            prefill_token_rate=sum(r.req.prompt for r in arrived) / window,
            mean_context=float(np.mean([r.req.prompt for r in arrived])) if arrived else 0.0,
        )
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


def recovery_intervals(
    timeline: list[dict], starts: list[float], slo: float, interval: float
) -> list[int | None]:
    """Per phase change into a long-prompt phase: control intervals until the windowed chat P99 TBT is
    within its SLO (0 = never out of it)."""
    out = []
    for t0 in starts[1::2]:
        after = [x for x in timeline if x["t"] > t0 and x.get("chat_tbt_p99") is not None]
        n = next((i for i, x in enumerate(after) if x["chat_tbt_p99"] <= slo), None)
        out.append(n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stallfree.operator.controller.phase_experiment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cost-model", required=True, help="cost_model.json from `stallfree profile`")
    p.add_argument("--out", required=True, help="folder for results.json and phase_shift.png")
    p.add_argument("--phase-seconds", type=float, default=600.0)
    p.add_argument("--chat-qps", type=float, default=0.6)
    p.add_argument("--summ-qps", type=float, default=0.05)
    p.add_argument("--chat-scale", type=float, default=0.05, help="CPU scaling of ShareGPT lengths")
    p.add_argument("--summ-scale", type=float, default=0.25, help="CPU scaling of arXiv lengths")
    p.add_argument("--chat-tbt-slo", type=float, default=1.5)
    p.add_argument("--chat-ttft-slo", type=float, default=20.0)
    p.add_argument("--budgets", default="128,256,384,512,768,1024,1536,2048")
    p.add_argument("--initial", type=int, default=512)
    p.add_argument("--interval", type=float, default=10.0, help="control interval, simulated seconds")
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from stallfree.bench.costmodel import CostModel

    fit = CostModel.load(a.cost_model)
    specs = (
        ClusterSpec("chat", Slo(a.chat_ttft_slo, a.chat_tbt_slo, a.chat_ttft_slo), priority=10),
        ClusterSpec("summarization", Slo(600.0, 30.0, 600.0), priority=0),
    )
    budgets = [int(b) for b in a.budgets.split(",")]
    cfg = ControllerConfig(budget_min=min(budgets), budget_max=max(budgets), align=32, interval_s=a.interval,
                           budget_home=a.initial, scale_in_after=3)  # fmt: skip
    reqs, starts = build_workload(
        a.phase_seconds, a.chat_qps, a.summ_qps, (a.chat_scale, a.summ_scale), a.seed
    )
    horizon = a.phase_seconds * len(starts) + 1800
    results: dict = {"config": vars(a), "num_requests": len(reqs), "static": {}, "adaptive": None}
    for b in budgets:
        recs, tl = run(reqs, fit, specs, cfg, b, False, a.interval, a.window, horizon)
        results["static"][b] = score(recs, specs, starts, a.phase_seconds)
        print(
            f"static {b:5d}: goodput {results['static'][b]['goodput']:.3f} req/s, attainment {results['static'][b]['attainment']:.1%}",
            file=sys.stderr,
        )
    recs, tl = run(reqs, fit, specs, cfg, a.initial, True, a.interval, a.window, horizon)
    ad = score(recs, specs, starts, a.phase_seconds)
    ad["timeline"] = tl
    ad["recovery_intervals"] = recovery_intervals(tl, starts, a.chat_tbt_slo, a.interval)
    results["adaptive"] = ad
    best_static = max(results["static"], key=lambda b: results["static"][b]["goodput"])
    oracle = sum(max(results["static"][b]["phases"][i]["good"] for b in budgets) for i in range(len(starts)))
    oracle_goodput = oracle / (a.phase_seconds * len(starts))
    results["summary"] = {
        "best_static_budget": best_static,
        "best_static_goodput": results["static"][best_static]["goodput"],
        "adaptive_goodput": ad["goodput"],
        "oracle_goodput": oracle_goodput,
        "adaptive_vs_best_static": ad["goodput"] / max(results["static"][best_static]["goodput"], 1e-9),
        "adaptive_vs_oracle": ad["goodput"] / max(oracle_goodput, 1e-9),
        "recovery_intervals": ad["recovery_intervals"],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, budgets, starts, a, out / "phase_shift.png")
    s = results["summary"]
    print(f"adaptive goodput {s['adaptive_goodput']:.3f} req/s (attainment {ad['attainment']:.1%}); best static {best_static}: "
          f"{s['best_static_goodput']:.3f}; oracle {s['oracle_goodput']:.3f}; adaptive/best static {s['adaptive_vs_best_static']:.2f}x, "
          f"adaptive/oracle {s['adaptive_vs_oracle']:.2f}x; recovery intervals {s['recovery_intervals']}")  # fmt: skip
    return 0


def plot(results: dict, budgets: list[int], starts: list[float], a, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    g = [results["static"][b]["goodput"] for b in budgets]
    ax1.bar([str(b) for b in budgets], g, color="#999", label="static budget")
    ax1.axhline(results["adaptive"]["goodput"], color="C3", lw=2, label="adaptive controller")
    ax1.axhline(results["summary"]["oracle_goodput"], color="C0", ls="--", label="per-phase oracle")
    ax1.set_xlabel("static token budget")
    ax1.set_ylabel("goodput (requests/s meeting SLOs)")
    ax1.legend()
    tl = results["adaptive"]["timeline"]
    ax2.step(
        [x["t"] for x in tl], [x["budget"] for x in tl], where="post", color="C3", label="adaptive budget"
    )
    for k, t0 in enumerate(starts):
        if k % 2 == 1:
            ax2.axvspan(
                t0, t0 + a.phase_seconds, color="C1", alpha=0.15, label="long prompts" if k == 1 else None
            )
    ax2b = ax2.twinx()
    ax2b.plot(
        [x["t"] for x in tl],
        [x.get("chat_tbt_p99") or np.nan for x in tl],
        color="C0",
        lw=0.8,
        label="chat P99 TBT",
    )
    ax2b.axhline(a.chat_tbt_slo, color="C0", ls=":", label="chat TBT SLO")
    ax2.set_xlabel("simulated seconds")
    ax2.set_ylabel("token budget")
    ax2b.set_ylabel("chat P99 TBT (s)")
    ax2.legend(loc="upper left")
    ax2b.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
