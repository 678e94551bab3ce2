"""`python -m experiments.capacity_study`: the paper's capacity table (Sarathi-Serve, Table 3) from a cost model.

The whole protocol in one command, on the simulator (the real scheduler on the cost model's clock):

1. SLOs the paper's way: strict and relaxed P99 TBT = 5x and 25x a decode-only iteration of 32 requests
   after a 4K prompt (predicted by the cost model);
2. a token budget for each (`stallfree tune`: the largest tile-aligned budget whose full iteration meets
   the SLO with a margin);
3. capacity = the largest QPS with P99 TBT <= SLO and P50 scheduling delay <= 2 s, every request served
   (expand, then bisect), for sarathi at each tuned budget, sarathi without hybrid batching, vllm and orca,
   on each trace and seed; medians over seeds, and sarathi's ratios against the baselines;
4. latency vs QPS: P99 TBT and P50 scheduling delay of each policy on a QPS grid (first seed);
5. the live plan: for sarathi at the strict budget and vllm, two QPS points bracketing the simulated
   strict capacity, for `scripts/gpu-capacity` to replay on the GPU.

The simulated replica has the GPU's KV cache (--gpu-memory-gb minus --weights-gb, in --kv-bytes-per-token).

Output (--out): capacity_study.json and capacity_study.png.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from stallfree.bench.metrics import meets_capacity_slo
from stallfree.bench.report import pyplot, table, write_json
from stallfree.bench.simulate import _simulate_once, simulate_capacity
from stallfree.bench.simulator import SimConfig, parse_policy_entry
from stallfree.bench.traces import load_trace
from stallfree.bench.tune import slo_from_decode, tune
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.slo import Slo

# The targets: (numerator entry, denominator entry, SLO name, at least).
TARGETS = (
    ("sarathi@strict", "vllm", "strict", 3.0),
    ("sarathi@relaxed", "vllm", "relaxed", 1.3),
    ("sarathi@strict", "orca", "strict", 2.0),
)
# The paper's Table 3 headline for comparison (Mistral-7B on one A100, arxiv; Yi-34B on two).
PAPER = {"Mistral-7B, 1x A100": 2.6, "Yi-34B, 2x A100 (TP2)": 3.7}


def kv_blocks(gpu_memory_gb: float, weights_gb: float, kv_bytes_per_token: int, block_size: int) -> int:
    """KV-cache blocks that fit in the GPU's memory beside the weights."""
    free = (gpu_memory_gb - weights_gb) * 1e9
    if free <= 0 or kv_bytes_per_token < 1 or block_size < 1:
        raise ValueError("need --gpu-memory-gb > --weights-gb, --kv-bytes-per-token >= 1, block size >= 1")
    return int(free // (kv_bytes_per_token * block_size))


def entries(policies: str, budgets: dict[str, int]) -> list[tuple[str, str, int]]:
    """`sarathi@strict,vllm` -> [(label, policy, budget)]: @strict / @relaxed name a tuned budget, @N a
    number; a bare name runs at the strict budget (vllm and orca do not use it)."""
    out = []
    for raw in (p.strip() for p in policies.split(",")):
        if not raw:
            continue
        name, _, which = raw.partition("@")
        if which in budgets:
            out.append((raw, name, budgets[which]))
        else:
            policy, b = parse_policy_entry(raw, budgets["strict"])
            out.append((raw, policy, b))
    return out


def _workload_args(args, seed: int, trace: str) -> SimpleNamespace:
    """What simulate_capacity reads from a command's arguments."""
    return SimpleNamespace(
        start_qps=args.start_qps,
        tolerance=args.tolerance,
        slo_delay=args.slo_delay,
        num_requests=args.num_requests,
        scale=1.0,
        max_model_len=args.max_model_len,
        seed=seed,
        trace=trace,
    )


_TRACES: dict = {}


def _trace(name: str):
    if name not in _TRACES:
        _TRACES[name] = load_trace(name)
    return _TRACES[name]


def compact(summary: dict) -> dict:
    """The numbers of one simulated run that the study keeps."""
    return {
        "tbt_p99_s": summary["tbt_s"]["p99"],
        "tbt_p50_s": summary["tbt_s"]["p50"],
        "scheduling_delay_p50_s": summary["scheduling_delay_s"]["p50"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "ok": summary["outcomes"]["ok"],
        "num_requests": summary["num_requests"],
        "num_preemptions": summary.get("num_preemptions", 0),
        "utilisation": summary.get("utilisation"),
    }


def sim_config(args, blocks: int, policy: str, budget: int) -> SimConfig:
    """The simulated GPU replica."""
    return SimConfig(policy=policy, token_budget=budget, max_num_seqs=args.max_num_seqs, num_kv_blocks=blocks,
                     block_size=args.block_size, max_model_len=args.max_model_len)  # fmt: skip


def replan(args, ents, slos: dict, blocks: int, cfg, cost: FittedCostModel) -> int:
    """--replan: redo the live plan of the study already in --out (its capacities are kept)."""
    path = Path(args.out) / "capacity_study.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"python -m experiments.capacity_study: --replan needs {path}: {e}", file=sys.stderr)
        return 2
    doc["live_plan"] = _live_plan(args, doc["summary"], ents, slos, blocks, cfg, cost)
    write_json(Path(args.out), "capacity_study.json", doc)
    png = plot(doc, Path(args.out)) if doc["sweep"] else "no plot (no sweep)"
    _print_plan(doc["live_plan"])
    print(f"saved {path} and {png}")
    return 0


def _print_plan(plan: dict) -> None:
    for lab, v in plan["servers"].items():
        pts = ", ".join(f"{r['qps']:g} QPS (simulated P99 TBT {r['tbt_p99_s'] * 1e3:.0f} ms, P50 delay "
                        f"{r['scheduling_delay_p50_s']:.2f} s: {'passes' if r['meets'] else 'fails'})"
                        for r in v["simulated_points"])  # fmt: skip
        print(f"live plan {lab} (capacity {v['simulated_capacity_qps']:.3g}): {pts}")
    print(
        f"live plan: {plan['num_requests']} requests per point, ~{plan['simulated_seconds']:.0f} s of load in all"
    )


def _search_task(task: tuple) -> tuple:
    """One capacity search (a worker process): (trace, seed, label) -> capacities and compact runs."""
    trace, seed, label, cfg, cost, slos, args = task
    wa = _workload_args(args, seed, trace)
    slo = Slo(ttft_p99=1e9, tbt_p99=min(slos), scheduling_delay_p50=args.slo_delay)
    res = simulate_capacity(_trace(trace), wa, cost, cfg, slos, slo)
    caps = {k: v["capacity_qps"] for k, v in res["by_tbt_slo"].items()}
    brackets = {k: v["final_bracket"] for k, v in res["by_tbt_slo"].items()}
    runs = {q: compact(s) for q, s in res["runs"].items()}
    return trace, seed, label, {"capacity_qps": caps, "bracket": brackets, "runs": runs}


def _sweep_task(task: tuple) -> tuple:
    trace, seed, label, cfg, cost, qps, args = task
    wa = _workload_args(args, seed, trace)
    s = _simulate_once(
        _trace(trace), wa, cost, cfg, qps, Slo(ttft_p99=1e9, tbt_p99=1.0, scheduling_delay_p50=args.slo_delay)
    )
    return trace, label, qps, compact(s)


def _map(fn, tasks: list, jobs: int, desc: str) -> list:
    out = []
    with tqdm(
        total=len(tasks), desc=desc, unit="search" if fn is _search_task else "run", file=sys.stderr
    ) as bar:
        if jobs <= 1:
            for t in tasks:
                out.append(fn(t))
                bar.update(1)
        else:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for r in pool.imap_unordered(fn, tasks):
                    out.append(r)
                    bar.update(1)
    return out


def ratios(caps: dict, num: str, den: str, slo_key: str, seeds: list[int]) -> dict:
    """Per-seed capacity ratios num / den and their median (inf when den has no capacity)."""
    per_seed = []
    for s in seeds:
        a, b = caps[num][s][slo_key], caps[den][s][slo_key]
        per_seed.append(a / b if b > 0 else math.inf)
    med_num = statistics.median(caps[num][s][slo_key] for s in seeds)
    med_den = statistics.median(caps[den][s][slo_key] for s in seeds)
    return {
        "per_seed": per_seed,
        "median": statistics.median(per_seed),
        "of_medians": med_num / med_den if med_den > 0 else math.inf,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.capacity_study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cost-model", required=True, help="cost_model.json (`stallfree profile`)")
    ap.add_argument("--traces", default="arxiv,sharegpt", help="comma list of traces (full length)")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma list of seeds (requests and arrivals)")
    ap.add_argument("--policies", default="sarathi@strict,sarathi@relaxed,sarathi-nohybrid@strict,vllm,orca",
                    help="entries; @strict / @relaxed: the budget tuned for that SLO")  # fmt: skip
    ap.add_argument(
        "--strict-x", type=float, default=5.0, help="strict SLO, x the reference decode iteration"
    )
    ap.add_argument("--relaxed-x", type=float, default=25.0, help="relaxed SLO, x the same")
    ap.add_argument("--slo-decodes", type=int, default=32, help="reference decode iteration: its decodes")
    ap.add_argument("--slo-context", type=int, default=4096, help="reference decode iteration: their context")
    ap.add_argument("--slo-delay", type=float, default=2.0, help="P50 scheduling delay SLO, s")
    ap.add_argument("--tune-decodes", type=int, default=32, help="tune: running decodes in a full iteration")
    ap.add_argument("--tune-context", type=int, default=4096, help="tune: their context")
    ap.add_argument(
        "--tune-prompt-len", type=int, default=8192, help="tune: the chunk ends a prompt this long"
    )
    ap.add_argument("--align", type=int, default=32, help="tile: budgets are multiples of this")
    ap.add_argument("--margin", type=float, default=0.9, help="tune: a full iteration within margin x SLO")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-memory-gb", type=float, default=141.0, help="GPU memory (H200: 141 GB)")
    ap.add_argument(
        "--weights-gb", type=float, default=16.06, help="model weights (Llama-3-8B bf16: 16.06 GB)"
    )
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072,
                    help="KV bytes per token (Llama-3-8B bf16: 32 layers x 2 x 8 heads x 128 x 2 B)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=512, help="requests per simulated run")
    ap.add_argument("--start-qps", type=float, default=1.0)
    ap.add_argument("--tolerance", type=float, default=0.05, help="capacity search: relative bracket width")
    ap.add_argument("--sweep-points", type=int, default=10, help="latency-vs-QPS points per policy (0: none)")
    ap.add_argument("--live-requests", type=int, default=200, help="live plan: requests per point")
    ap.add_argument("--live-seed", type=int, default=0, help="live plan: seed of its requests")
    ap.add_argument("--live-margin", type=float, default=0.2, help="live plan: the low point passes SLOs this "
                    "much tighter, the high point fails SLOs this much looser")  # fmt: skip
    ap.add_argument(
        "--replan", action="store_true", help="only redo the live plan (and the plot) of the study in --out"
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (2 cores shared: 1-2)")
    ap.add_argument("--out", default="results/capacity-study")
    args = ap.parse_args(argv)
    try:
        cost = FittedCostModel.load(args.cost_model)
        traces = [t.strip() for t in args.traces.split(",") if t.strip()]
        for t in traces:
            _trace(t)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        blocks = kv_blocks(args.gpu_memory_gb, args.weights_gb, args.kv_bytes_per_token, args.block_size)
        slos, tuned = {}, {}
        for name, x in (("strict", args.strict_x), ("relaxed", args.relaxed_x)):
            slos[name] = slo_from_decode(cost, x, args.slo_decodes, args.slo_context)
            tuned[name] = tune(cost, slos[name], decodes=args.tune_decodes, decode_context=args.tune_context,
                               prompt_len=args.tune_prompt_len, align=args.align,
                               max_budget=args.max_model_len, margin=args.margin)  # fmt: skip
            if not tuned[name]["feasible"]:
                raise ValueError(f"{name} SLO: {tuned[name]['note']}")
        budgets = {k: tuned[k]["token_budget"] for k in tuned}
        ents = entries(args.policies, budgets)
        if not seeds or not ents:
            raise ValueError("need at least one seed and one policy")
    except ValueError as e:
        print(f"python -m experiments.capacity_study: {e}", file=sys.stderr)
        return 2
    decode_it = slos["strict"] / args.strict_x
    print(f"reference decode iteration ({args.slo_decodes} decodes at {args.slo_context}): {decode_it * 1e3:.1f} ms; "
          f"strict SLO {slos['strict'] * 1e3:.0f} ms (budget {budgets['strict']}), relaxed {slos['relaxed'] * 1e3:.0f} ms "
          f"(budget {budgets['relaxed']}); KV cache {blocks} blocks ({blocks * args.block_size} tokens)",
          file=sys.stderr)  # fmt: skip

    def cfg(policy: str, budget: int) -> SimConfig:
        return sim_config(args, blocks, policy, budget)

    if args.replan:
        return replan(args, ents, slos, blocks, cfg, cost)
    slo_list = [slos["strict"], slos["relaxed"]]
    tasks = [
        (t, s, lab, cfg(p, b), cost, slo_list, args) for t in traces for s in seeds for lab, p, b in ents
    ]
    found = _map(_search_task, tasks, args.jobs, "capacity searches")
    key = {name: str(v) for name, v in slos.items()}
    results: dict = {t: {lab: {} for lab, _, _ in ents} for t in traces}
    for t, s, lab, r in found:
        results[t][lab][s] = r
    summary = {}
    for t in traces:
        caps = {lab: {s: {n: results[t][lab][s]["capacity_qps"][key[n]] for n in slos} for s in seeds}
                for lab, _, _ in ents}  # fmt: skip
        med = {lab: {n: statistics.median(caps[lab][s][n] for s in seeds) for n in slos} for lab in caps}
        rat = {
            f"{a} / {b} @ {n}": ratios(caps, a, b, n, seeds)
            for a, b, n, _ in TARGETS
            if a in caps and b in caps
        }
        summary[t] = {"capacity_qps": caps, "median_capacity_qps": med, "ratios": rat}
    verdict = []
    if "arxiv" in summary:
        for a, b, n, target in TARGETS:
            r = summary["arxiv"]["ratios"].get(f"{a} / {b} @ {n}")
            if r:
                verdict.append({"ratio": f"{a} / {b}", "slo": n, "median": r["median"], "target": target,
                                "met": r["median"] >= target})  # fmt: skip
    sweep = _sweep(args, traces, seeds[0], ents, summary, cfg, cost)
    live = _live_plan(args, summary, ents, slos, blocks, cfg, cost)
    doc = {
        "description": "simulated capacity (the real scheduler on the cost model's clock), paper's protocol",
        "cost_model": {"path": args.cost_model, **cost.to_json()},
        "args": vars(args),
        "slo": {"reference_decode_iteration_s": decode_it, "strict_s": slos["strict"], "relaxed_s": slos["relaxed"],
                "rule": f"{args.strict_x:g}x / {args.relaxed_x:g}x a decode-only iteration of {args.slo_decodes} "
                        f"decodes at {args.slo_context} tokens of context", "scheduling_delay_p50_s": args.slo_delay},
        "budgets": {n: {k: v for k, v in tuned[n].items() if k != "budgets"} for n in tuned},
        "kv_cache": {"blocks": blocks, "block_size": args.block_size, "tokens": blocks * args.block_size},
        "entries": [{"label": lab, "policy": p, "token_budget": b} for lab, p, b in ents],
        "summary": summary,
        "targets": verdict,
        "paper": PAPER,
        "sweep": sweep,
        "live_plan": live,
        "searches": {t: {lab: {str(s): r for s, r in v.items()} for lab, v in results[t].items()} for t in traces},
    }  # fmt: skip
    out = Path(args.out)
    path = write_json(out, "capacity_study.json", doc)
    png = plot(doc, out) if doc["sweep"] else "no plot (--sweep-points 0)"
    _print(doc, traces, ents, slos)
    print(f"\nsaved {path} and {png}")
    return 0


def _sweep(args, traces, seed, ents, summary, cfg, cost) -> dict:
    """P99 TBT and P50 scheduling delay on a QPS grid (log-spaced around the capacities), first seed."""
    if args.sweep_points < 1:
        return {}
    tasks = []
    for t in traces:
        caps = [c for lab in summary[t]["median_capacity_qps"].values() for c in lab.values() if c > 0]
        lo, hi = (min(caps) / 2, max(caps) * 1.5) if caps else (0.25, 4.0)
        grid = [float(f"{q:.3g}") for q in np.geomspace(lo, hi, args.sweep_points)]
        tasks += [(t, seed, lab, cfg(p, b), cost, q, args) for lab, p, b in ents for q in grid]
    out: dict = {t: {lab: {} for lab, _, _ in ents} for t in traces}
    for t, lab, q, s in _map(_sweep_task, tasks, args.jobs, "latency vs QPS"):
        out[t][lab][str(q)] = s
    return {t: {lab: dict(sorted(v.items(), key=lambda kv: float(kv[0]))) for lab, v in d.items()}
            for t, d in out.items()}  # fmt: skip


LIVE_LOW = (0.8, 0.7, 0.6, 0.5)  # x the capacity: the first that passes is the low point
LIVE_HIGH = (1.25, 1.5, 1.75, 2.0)  # the first that fails is the high point


def _live_plan(args, summary: dict, ents, slos: dict, blocks: int, cfg, cost) -> dict:
    """For sarathi at the strict budget and vllm: two QPS points around the simulated strict capacity (arxiv),
    each checked by simulating the live run itself (--live-requests requests, --live-seed): the low point
    must pass and the high point fail, each by --live-margin, so that a live run shows the same bracket
    unless the model is off by more than that. Also the time they take."""
    trace = "arxiv" if "arxiv" in summary else next(iter(summary))
    wa = _workload_args(args, args.live_seed, trace)
    wa.num_requests = args.live_requests
    slo = Slo(ttft_p99=1e9, tbt_p99=slos["strict"], scheduling_delay_p50=args.slo_delay)
    m = args.live_margin
    servers = {}
    for lab, policy, budget in ents:
        if lab not in ("sarathi@strict", "vllm"):
            continue
        cap = summary[trace]["median_capacity_qps"][lab]["strict"]
        c = cfg(policy, budget)

        def run(q: float, c: SimConfig = c) -> dict:
            s = _simulate_once(_trace(trace), wa, cost, c, q, slo)
            return {"qps": q, "meets": meets_capacity_slo(s, slo.tbt_p99, slo.scheduling_delay_p50),
                    "meets_with_margin": meets_capacity_slo(s, slo.tbt_p99 * (1 - m), slo.scheduling_delay_p50 * (1 - m)),
                    "fails_with_margin": not meets_capacity_slo(s, slo.tbt_p99 * (1 + m), slo.scheduling_delay_p50 * (1 + m)),
                    "makespan_s": s["makespan_s"], **compact(s)}  # fmt: skip

        # NOTE: each point clears the criterion by the margin, so a model error below it keeps the verdict
        low = next((r for f in LIVE_LOW if (r := run(round(cap * f, 3)))["meets_with_margin"]), None)
        high = next((r for f in LIVE_HIGH if (r := run(round(cap * f, 3)))["fails_with_margin"]), None)
        pts = [r for r in (low, high) if r]
        servers[lab] = {"policy": policy, "token_budget": budget, "simulated_capacity_qps": cap,
                        "qps": [r["qps"] for r in pts], "simulated_points": pts,
                        "bracketed": low is not None and high is not None}  # fmt: skip
    return {
        "trace": trace,
        "num_requests": args.live_requests,
        "seed": args.live_seed,
        "margin": args.live_margin,
        "tbt_slo_s": slos["strict"],
        "scheduling_delay_slo_s": args.slo_delay,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": blocks,
        "simulated_seconds": sum(r["makespan_s"] for v in servers.values() for r in v["simulated_points"]),
        "servers": servers,
    }


def _print(doc: dict, traces, ents, slos) -> None:
    for t in traces:
        s = doc["summary"][t]
        rows = [[lab, *(f"{s['median_capacity_qps'][lab][n]:.3g}" for n in slos),
                 " ".join(f"{s['capacity_qps'][lab][k]['strict']:.3g}" for k in s["capacity_qps"][lab])]
                for lab, _, _ in ents]  # fmt: skip
        print(table(["policy", *(f"median cap @ {n} {slos[n] * 1e3:.0f} ms" for n in slos), "strict per seed"], rows,
                    title=f"\n{t}: capacity (QPS), median over seeds"))  # fmt: skip
        for name, r in s["ratios"].items():
            print(f"  {name}: median {r['median']:.2f}x (per seed {', '.join(f'{x:.2f}' for x in r['per_seed'])}; "
                  f"of medians {r['of_medians']:.2f}x)")  # fmt: skip
    _print_plan(doc["live_plan"])
    for v in doc["targets"]:
        print(f"target {v['ratio']} @ {v['slo']}: {v['median']:.2f}x vs >= {v['target']:g}x: "
              f"{'met' if v['met'] else 'NOT met'}")  # fmt: skip


def plot(doc: dict, out: Path) -> Path:
    """Per trace: P99 TBT and P50 scheduling delay vs QPS for each policy (the sweep), SLOs dashed."""
    plt = pyplot()
    traces = list(doc["summary"])
    fig, axes = plt.subplots(len(traces), 2, figsize=(12, 4.2 * len(traces)), squeeze=False)
    slo = doc["slo"]
    for i, t in enumerate(traces):
        a1, a2 = axes[i]
        for lab, runs in (doc["sweep"].get(t) or {}).items():
            q = [float(k) for k in runs]
            a1.plot(
                q, [(r["tbt_p99_s"] or math.nan) * 1e3 for r in runs.values()], marker="o", ms=3, label=lab
            )
            a2.plot(
                q,
                [r["scheduling_delay_p50_s"] or math.nan for r in runs.values()],
                marker="o",
                ms=3,
                label=lab,
            )
        for name in ("strict", "relaxed"):
            a1.axhline(slo[f"{name}_s"] * 1e3, color="grey", ls="--", lw=0.8)
            a1.text(a1.get_xlim()[0], slo[f"{name}_s"] * 1e3, f" {name} SLO", fontsize=7, va="bottom")
        a2.axhline(slo["scheduling_delay_p50_s"], color="grey", ls="--", lw=0.8)
        a1.set_yscale("log")
        a1.set_ylabel("P99 TBT, ms")
        a2.set_ylabel("P50 scheduling delay, s")
        a2.set_yscale("symlog", linthresh=0.1)
        a2.set_ylim(bottom=0)
        for a in (a1, a2):
            a.set_xlabel("QPS (Poisson)")
            a.set_title(f"{t} (simulated, seed {doc['args']['seeds'].split(',')[0]})")
            a.legend(fontsize=7)
    fig.tight_layout()
    path = out / "capacity_study.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
