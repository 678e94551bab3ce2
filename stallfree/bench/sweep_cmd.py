"""`stallfree bench sweep`: fixed-load runs over policies and token budgets, one server per configuration.

For the paper's ablation (`--policies sarathi,sarathi-nohybrid,orca`: both, chunking only, hybrid batching
only) and the budget sweep (`--policies sarathi --token-budgets 128,256,512,1024,2048`): every configuration
gets the same requests and arrivals at --qps. Reports P50/P99 TTFT and TBT, scheduling delay and goodput;
with --cost-model also the simulator's prediction for the same configuration and load (its accuracy).

Output (--out): sweep.json, sweep.png (TTFT-TBT-goodput Pareto view), one server log per configuration.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from stallfree.bench.capacity_cmd import warm_up
from stallfree.bench.launcher import ServerProcess, ServerSpec, iteration_log_args
from stallfree.bench.metrics import summarize
from stallfree.bench.report import latency_cells, ms, pyplot, table, write_json
from stallfree.bench.serve_cmd import bench_once, reset_prefix_cache
from stallfree.bench.simulate import caching_modes, config_label, workload_of
from stallfree.bench.traces import Trace
from stallfree.slo import Slo


def _predict(policy: str, budget: int, trace: Trace, args, slo: Slo, caching: bool = True) -> dict | None:
    if not args.cost_model:
        return None
    from stallfree.bench.simulate import contention_of, sim_config
    from stallfree.bench.simulator import simulate
    from stallfree.costmodel.fitted import FittedCostModel

    cost = FittedCostModel.load(args.cost_model)
    cfg = sim_config(args, policy, budget, contention_of(args.contention, cost), caching)
    wl = workload_of(trace, args, args.qps)
    return summarize(simulate(wl, cost, cfg).records, slo)


def set_budget(url: str, budget: int) -> None:
    """Change a running stallfree server's token budget (PATCH /admin/v1/config), and check it took."""
    r = httpx.patch(f"{url}/admin/v1/config", json={"tokenBudget": budget}, timeout=10.0)
    r.raise_for_status()
    got = httpx.get(f"{url}/admin/v1/config", timeout=10.0).json()["tokenBudget"]
    if got != budget:
        raise RuntimeError(f"asked the server for token budget {budget}, it reports {got}")


def _plot(rows: list[dict], out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for r in rows:
        s = r["measured"]
        x, y = s["tbt_s"]["p99"], s["ttft_s"]["p50"]
        if x is None or y is None:
            continue
        a1.scatter(x * 1e3, y, s=30 + 400 * s["good_fraction"], alpha=0.7)
        a1.annotate(
            f"{r['policy']} b={r['token_budget']}\ngoodput {s['goodput_rps']:.2f}/s", (x * 1e3, y), fontsize=7
        )
    a1.set_xlabel("P99 TBT, ms (measured)")
    a1.set_ylabel("P50 TTFT, s (measured)")
    a1.set_title("TTFT-TBT trade-off (marker size = share meeting both SLOs)")
    sarathi = sorted((r for r in rows if r["policy"] == "sarathi"), key=lambda r: r["token_budget"])
    if len(sarathi) > 1:
        b = [r["token_budget"] for r in sarathi]
        a2.plot(
            b, [(r["measured"]["tbt_s"]["p99"] or 0) * 1e3 for r in sarathi], marker="o", label="P99 TBT ms"
        )
        a2.plot(
            b, [(r["measured"]["ttft_s"]["p50"] or 0) * 1e3 for r in sarathi], marker="s", label="P50 TTFT ms"
        )
        if all(r.get("predicted") for r in sarathi):
            a2.plot(
                b,
                [(r["predicted"]["tbt_s"]["p99"] or 0) * 1e3 for r in sarathi],
                ls="--",
                label="P99 TBT ms (sim)",
            )
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("token budget")
        ax3 = a2.twinx()
        ax3.plot(
            b, [r["measured"]["goodput_rps"] for r in sarathi], color="green", marker="^", label="goodput/s"
        )
        ax3.set_ylabel("goodput, req/s")
        a2.legend(fontsize=7, loc="upper left")
        a2.set_title("sarathi: budget sweep")
    else:
        a2.axis("off")
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main_sweep(args: argparse.Namespace, trace: Trace, slo: Slo) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    budgets = [int(b) for b in args.token_budgets.split(",")]
    configs = [(p, b) for p in policies for b in (budgets if p.startswith("sarathi") else budgets[:1])]
    wl = workload_of(trace, args, args.qps)
    rows = []
    t0 = time.time()
    for policy, caching in [
        (p, c) for p in dict.fromkeys(p for p, _ in configs) for c in caching_modes(args)
    ]:
        mine = [b for p, b in configs if p == policy]
        label = config_label(policy, caching)
        spec = ServerSpec(policy=policy, token_budget=mine[0], max_num_seqs=args.max_num_seqs,
                          num_kv_blocks=args.num_kv_blocks, chunk_align=args.chunk_align,
                          chunk_context_scale=args.chunk_context_scale, model=args.model,
                          load_format=args.load_format, threads=args.threads,
                          extra_args=iteration_log_args(args.iteration_logs, out, label),
                          prefix_caching=caching)  # fmt: skip
        print(f"{label}: starting stallfree serve", file=sys.stderr, flush=True)
        with ServerProcess(spec, out / f"server-{label}.log") as server:
            warm_up(server.url, trace, args)
            for budget in mine:
                # One server per policy; the budget changes at run time through the admin API.
                set_budget(server.url, budget)
                reset_prefix_cache(server.url)  # each run starts from an empty prefix cache
                s, _ = bench_once(
                    server.url,
                    wl,
                    slo,
                    model=args.model_name,
                    logprobs=True,  # our own servers: one chunk per token, so every gap is seen
                    desc=f"{label} b={budget}",
                )
                rows.append({"policy": label, "prefix_caching": caching, "token_budget": budget, "measured": s,
                             "predicted": _predict(policy, budget, trace, args, slo, caching)})  # fmt: skip
    wall = time.time() - t0
    path = write_json(
        out, "sweep.json", {"args": vars(args), "workload": wl.describe(), "wall_s": wall, "rows": rows}
    )
    png = _plot(rows, out)
    headers = [
        "policy",
        "budget",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TBT p50 ms",
        "TBT p99 ms",
        "sched p50 ms",
        "goodput/s",
        "ok",
    ]
    if args.cost_model:
        headers += ["sim TBT p99 ms", "sim TTFT p50 ms"]
    trows = []
    for r in rows:
        s, p = r["measured"], r["predicted"]
        row = [
            r["policy"],
            r["token_budget"],
            *latency_cells(s),
            f"{s['outcomes']['ok']}/{s['num_requests']}",
        ]
        if p:
            row += [ms(p["tbt_s"]["p99"]), ms(p["ttft_s"]["p50"])]
        trows.append(row)
    d = wl.describe()
    print(
        table(
            headers,
            trows,
            title=(
                f"{d['trace']} x{args.scale:g} (median prompt {d['prompt_tokens_median']:.0f}, output "
                f"{d['output_tokens_median']:.0f}), {args.num_requests} requests at {args.qps:g} QPS, seed {args.seed}; "
                f"SLO TTFT {slo.ttft_p99:g} s, TBT {slo.tbt_p99 * 1e3:.0f} ms; {wall / 60:.1f} min"
            ),
        )
    )
    print(f"saved {path} and {png}")
    return 0
