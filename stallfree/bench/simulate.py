"""`stallfree simulate`: predict TTFT / TBT / scheduling delay / goodput / capacity for a trace, policy and
token budget without running the model, and plan replicas for a target QPS.

The simulator drives the engine's real scheduler with a simulated clock that advances by the profiled cost
model's iteration time (see `stallfree profile`). Several policies and budgets may be given (comma lists):
every combination is simulated on the same requests and arrivals.

Output (--out): simulate.json (summaries, capacity searches, replica plans), simulate.png (TBT and TTFT
distributions; capacity per configuration).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from stallfree.bench.capacity import CapacitySearch
from stallfree.bench.metrics import meets_capacity_slo, summarize
from stallfree.bench.report import latency_cells, pyplot, table, write_json
from stallfree.bench.sharing import KINDS, Sharing, parse_turns
from stallfree.bench.simulator import DEFAULT_KV_BLOCKS, POLICY_NAMES, SimConfig, simulate
from stallfree.bench.traces import Trace, load_trace, make_workload
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.slo import Slo


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """Trace and SLO options shared by simulate and the bench commands."""
    ap.add_argument("--trace", default="arxiv", help="sharegpt, arxiv, or a CSV path (default: arxiv)")
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply prompt and output lengths (CPU: 0.125)"
    )
    ap.add_argument(
        "--max-model-len", type=int, default=8192, help="clip prompt + output to this (SmolLM2: 8192)"
    )
    ap.add_argument("--max-output-tokens", type=int, default=None, help="cap every request's output "
                    "(bench capacity; e.g. 32 for chat-like short answers)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=100, help="requests per run")
    ap.add_argument("--seed", type=int, default=0, help="seeds request sampling and arrivals")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="TTFT SLO, seconds (for goodput)")
    ap.add_argument(
        "--slo-tbt", default="1.0", help="P99 TBT Slo(s), seconds; a comma list searches capacity for each"
    )
    ap.add_argument("--slo-delay", type=float, default=2.0, help="P50 scheduling delay SLO for capacity, s")
    ap.add_argument("--workload", choices=KINDS, default="trace", help="trace: every prompt its own ids; "
                    "system-prompt: one shared system prompt + trace-length user turns; multi-turn: "
                    "conversations whose turns resend the conversation so far (see stallfree.bench.sharing)")  # fmt: skip
    ap.add_argument(
        "--system-prompt-tokens", type=int, default=1000, help="system-prompt workload: its length"
    )
    ap.add_argument("--turns", default="3-6", help="multi-turn workload: turns per conversation, MIN-MAX")
    ap.add_argument("--conversations", type=int, default=8, help="multi-turn workload: conversations at once")
    ap.add_argument("--prefix-caching", default="on", help="on, off, or on,off (each in turn, side by side): "
                    "the servers' --[no-]enable-prefix-caching and the simulator's")  # fmt: skip


def load_workload_trace(args) -> Trace:
    """--trace with the sharing the --workload options ask for."""
    lo, hi = parse_turns(args.turns)
    sharing = Sharing(args.workload, args.system_prompt_tokens, lo, hi, args.conversations)
    return replace(load_trace(args.trace), sharing=sharing)


def workload_of(trace: Trace, args, qps: float, *, num_requests: int | None = None, seed: int | None = None):
    """The workload the --workload options describe (scale, length clip, output cap) at `qps`: one
    definition for the servers' runs and the simulator's, so both see the same requests."""
    return make_workload(
        trace,
        args.num_requests if num_requests is None else num_requests,
        qps=qps,
        scale=args.scale,
        max_model_len=args.max_model_len,
        seed=args.seed if seed is None else seed,
        max_output_tokens=getattr(args, "max_output_tokens", None),
    )


def caching_modes(args) -> list[bool]:
    """--prefix-caching on / off / on,off -> [True], [False], [True, False]."""
    modes = [m.strip() for m in str(args.prefix_caching).split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise ValueError(f"--prefix-caching must be on, off or on,off; got {args.prefix_caching!r}")
    return [m == "on" for m in dict.fromkeys(modes)]


def config_label(name: str, caching: bool) -> str:
    """A configuration's name in reports: `sarathi`, or `sarathi-nocache` with prefix caching off."""
    return name if caching else f"{name}-nocache"


def tbt_slos(arg: str) -> list[float]:
    vals = sorted({float(x) for x in arg.split(",") if x.strip()})
    if not vals or min(vals) <= 0:
        raise ValueError(f"--slo-tbt needs positive seconds, got {arg!r}")
    return vals


def _simulate_once(trace, args, cost: FittedCostModel, cfg: SimConfig, qps: float, slo: Slo) -> dict:
    wl = workload_of(trace, args, qps)
    res = simulate(wl, cost, cfg)
    s = summarize(res.records, slo)
    s.update(
        qps=qps,
        num_iterations=res.num_iterations,
        num_preemptions=res.num_preemptions,
        utilisation=res.busy_s / s["makespan_s"] if s["makespan_s"] else 0.0,
    )
    return s


def simulate_capacity(trace, args, cost, cfg, slos: list[float], slo: Slo, bar=None) -> dict:
    """Capacity for each TBT SLO, from one shared set of simulated runs."""

    def evaluate(q: float) -> dict:
        if bar is not None:
            bar.set_postfix_str(f"{cfg.policy} b={cfg.token_budget} {q:.3g} qps")
        return _simulate_once(trace, args, cost, cfg, q, slo)

    search = CapacitySearch(evaluate, start_qps=args.start_qps, tolerance=args.tolerance, max_runs=20)
    out = {}
    for tbt in sorted(slos, reverse=True):  # relaxed first: its bracket narrows the strict one's
        r = search.search(lambda s, t=tbt: meets_capacity_slo(s, t, args.slo_delay))
        out[str(tbt)] = r.to_json()
    for tbt in slos:  # every run informs every SLO: tighten each bracket with the later searches' runs
        lo, hi = search.bracket(lambda s, t=tbt: meets_capacity_slo(s, t, args.slo_delay))
        out[str(tbt)].update(final_bracket=[lo, hi], capacity_qps=lo)
    return {"by_tbt_slo": out, "runs": {str(q): s for q, s in sorted(search.runs.items())}}


def sim_config(
    args,
    policy: str,
    budget: int,
    contention: float,
    caching: bool = True,
    time_target: float | None = None,
    slo: tuple[float, float] | None = None,
) -> SimConfig:
    """The simulated replica for a bench command's server knobs (--max-num-seqs, --num-kv-blocks, ...);
    with `time_target`, time-budgeted iterations under the one cluster's (P99 TBT, P99 TTFT) `slo`."""
    tbt, ttft = slo or (None, None)
    return SimConfig(
        policy=policy,
        token_budget=budget,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks or DEFAULT_KV_BLOCKS,
        max_model_len=args.max_model_len,
        chunk_align=args.chunk_align,
        chunk_context_scale=getattr(args, "chunk_context_scale", None),  # not in every caller's namespace
        overhead_s=args.overhead_ms / 1e3,
        contention=contention,
        enable_prefix_caching=caching,
        time_target=time_target,
        tbt_slo=tbt,
        ttft_slo=ttft,
    )


def contention_of(arg: str | float, cost: FittedCostModel) -> float:
    """--contention: a factor, or 'profile' for the wall/CPU time factor measured while profiling."""
    if str(arg) == "profile":
        return float(cost.meta.get("contention_factor", 1.0))
    try:
        f = float(arg)
    except ValueError as e:
        raise ValueError(f"--contention must be a number or 'profile', got {arg!r}") from e
    if f <= 0:
        raise ValueError(f"--contention must be > 0, got {f}")
    return f


def plan_replicas(capacity_qps: float, target_qps: float) -> int | None:
    if capacity_qps <= 0:
        return None
    return max(1, math.ceil(target_qps / capacity_qps - 1e-9))


def _plots(results: list[dict], out: Path, slos: list[float]) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        lab = f"{r['policy']} b={r['token_budget']}"
        tbt = np.sort(np.array(r["tbt_gaps"])) * 1e3
        ttft = np.sort(np.array(r["ttfts"]))
        if len(tbt):
            axes[0].plot(tbt, np.linspace(0, 1, len(tbt)), label=lab)
        if len(ttft):
            axes[1].plot(ttft, np.linspace(0, 1, len(ttft)), label=lab)
    for s in slos:
        axes[0].axvline(s * 1e3, color="grey", ls="--", lw=0.8)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("TBT ms")
    axes[0].set_ylabel("CDF")
    axes[0].set_title("Inter-token gaps (simulated)")
    axes[1].set_xlabel("TTFT s")
    axes[1].set_title("TTFT (simulated)")
    axes[0].legend(fontsize=7)
    caps = [(f"{r['policy']}\nb={r['token_budget']}", r.get("capacity")) for r in results]
    if any(c for _, c in caps):
        width = 0.8 / len(slos)
        for k, s in enumerate(slos):
            vals = [(c["by_tbt_slo"][str(s)]["capacity_qps"] if c else 0) for _, c in caps]
            axes[2].bar(np.arange(len(caps)) + k * width, vals, width, label=f"P99 TBT <= {s * 1e3:.0f} ms")
        axes[2].set_xticks(
            np.arange(len(caps)) + width * (len(slos) - 1) / 2, [n for n, _ in caps], fontsize=7
        )
        axes[2].set_ylabel("capacity, QPS")
        axes[2].set_title("Capacity (simulated)")
        axes[2].legend(fontsize=7)
    else:
        axes[2].axis("off")
    fig.tight_layout()
    path = out / "simulate.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stallfree simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(ap)
    ap.add_argument(
        "--cost-model", default="results/profile/cost_model.json", help="from `stallfree profile`"
    )
    ap.add_argument("--policy", default="sarathi,vllm,orca", help=f"comma list of {', '.join(POLICY_NAMES)}")
    ap.add_argument("--token-budget", default="512", help="comma list of token budgets (sarathi)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=DEFAULT_KV_BLOCKS)
    ap.add_argument("--chunk-align", type=int, default=0, help="round prefill chunks down to this tile")
    ap.add_argument(
        "--chunk-context-scale",
        type=int,
        default=None,
        metavar="C",
        help="sarathi: charge chunks for their context (stallfree serve --chunk-context-scale)",
    )
    ap.add_argument("--overhead-ms", type=float, default=0.0, help="extra time per iteration (server loop)")
    ap.add_argument("--contention", default="1", help="multiply predicted iteration times (a shared box); "
                    "'profile' = the wall/CPU factor measured while profiling")  # fmt: skip
    ap.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate of the fixed-load run")
    ap.add_argument("--capacity", action="store_true", help="also search capacity under each --slo-tbt")
    ap.add_argument("--start-qps", type=float, default=1.0, help="capacity search: first QPS tried")
    ap.add_argument("--tolerance", type=float, default=0.03, help="capacity search: relative bracket width")
    ap.add_argument("--target-qps", type=float, default=None, help="plan replicas for this total QPS")
    ap.add_argument("--out", default="results/simulate", help="folder for simulate.json and plots")
    args = ap.parse_args(argv)
    try:
        slos = tbt_slos(args.slo_tbt)
        cost = FittedCostModel.load(args.cost_model)
        trace = load_workload_trace(args)
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        budgets = [int(b) for b in args.token_budget.split(",")]
        modes = caching_modes(args)
        configs = [
            sim_config(args, p, b, contention_of(args.contention, cost), caching)
            for p in policies
            for b in (budgets if p.startswith("sarathi") else budgets[:1])
            for caching in modes
        ]
        for c in configs:
            c.scheduler()  # validates policy / budget with the scheduler's own messages
        slo = Slo(ttft_p99=args.slo_ttft, tbt_p99=slos[0], scheduling_delay_p50=args.slo_delay)
    except ValueError as e:
        print(f"stallfree simulate: {e}", file=sys.stderr)
        return 2
    if args.capacity or args.target_qps:
        args.capacity = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tqdm(total=len(configs), desc="simulate", unit="config", file=sys.stderr) as bar:
        for cfg in configs:
            wl = workload_of(trace, args, args.qps)
            res = simulate(wl, cost, cfg)
            s = summarize(res.records, slo)
            r = {
                "policy": config_label(cfg.policy, cfg.enable_prefix_caching),
                "prefix_caching": cfg.enable_prefix_caching,
                "token_budget": cfg.token_budget,
                "qps": args.qps,
                "summary": s,
                "num_iterations": res.num_iterations,
                "workload": wl.describe(),
                "tbt_gaps": [g for rec in res.records for g in rec.tbts],
                "ttfts": [rec.ttft for rec in res.records if rec.ttft is not None],
            }
            if args.capacity:
                r["capacity"] = simulate_capacity(trace, args, cost, cfg, slos, slo, bar)
                if args.target_qps:
                    r["replica_plan"] = {}
                    for t in slos:
                        cap = r["capacity"]["by_tbt_slo"][str(t)]["capacity_qps"]
                        n = plan_replicas(cap, args.target_qps)
                        plan = {"capacity_per_replica_qps": cap, "replicas": n}
                        if n:
                            s_rep = _simulate_once(trace, args, cost, cfg, args.target_qps / n, slo)
                            plan["per_replica_check"] = {
                                "qps": args.target_qps / n,
                                "tbt_p99_s": s_rep["tbt_s"]["p99"],
                                "ttft_p50_s": s_rep["ttft_s"]["p50"],
                                "meets": meets_capacity_slo(s_rep, t, args.slo_delay),
                            }
                        r["replica_plan"][str(t)] = plan
            results.append(r)
            bar.update(1)
    png = _plots(results, out, slos)
    rows = []
    for r in results:
        s = r["summary"]
        row = [
            r["policy"],
            r["token_budget"],
            *latency_cells(s),
        ]
        if args.capacity:
            row += [f"{r['capacity']['by_tbt_slo'][str(t)]['capacity_qps']:.3g}" for t in slos]
        if args.target_qps:
            row += [str(r["replica_plan"][str(t)]["replicas"]) for t in slos]
        rows.append(row)
    headers = [
        "policy",
        "budget",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TBT p50 ms",
        "TBT p99 ms",
        "sched p50 ms",
        "goodput/s",
    ]
    if args.capacity:
        headers += [f"cap@{t * 1e3:.0f}ms" for t in slos]
    if args.target_qps:
        headers += [f"replicas@{t * 1e3:.0f}ms" for t in slos]
    wl = results[0]["workload"]
    print(
        table(
            headers,
            rows,
            title=(
                f"simulated: {wl['trace']} x{args.scale:g} (clipped to {args.max_model_len}: {wl['num_clipped']} requests), "
                f"{args.num_requests} requests at {args.qps:g} QPS, seed {args.seed}; cost model {args.cost_model}"
            ),
        )
    )
    for r in results:
        r.pop("tbt_gaps")  # large; the percentiles are in the summary
    path = write_json(
        out, "simulate.json", {"args": vars(args), "cost_model": cost.to_json(), "results": results}
    )
    print(f"\nsaved {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
