"""`stallfree bench capacity`: the paper's capacity comparison, one engine per policy, side by side.

For each policy a `stallfree serve` is started (same model, budget, KV cache, trace, seed), warmed up, and
searched: capacity = the largest QPS whose run has P99 TBT <= SLO and P50 scheduling delay <= 2 s with every
request served. Expand then bisect to --tolerance. Every --slo-tbt is searched from the SAME runs (relaxed
first). `--peer-url` adds an external OpenAI-compatible server as a column (its scheduling delay is not
reported, so its P50 TTFT stands in: stricter for it). With --cost-model the simulator's capacity for the
same configuration is reported beside the measured one.

Output (--out): capacity.json (every run's summary, every search), capacity.png, one server log per policy.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from stallfree.bench.capacity import CapacitySearch
from stallfree.bench.host import describe
from stallfree.bench.launcher import ServerProcess, ServerSpec, iteration_log_args
from stallfree.bench.metrics import meets_attainment, meets_capacity_slo, slo_attainment
from stallfree.bench.report import pyplot, table, write_json
from stallfree.bench.serve_cmd import bench_once, load_text_prompts, reset_prefix_cache
from stallfree.bench.simulate import caching_modes, config_label, workload_of
from stallfree.bench.simulator import ServerEntry, parse_server_entry
from stallfree.bench.traces import Trace
from stallfree.slo import Slo


def warm_up(url: str, trace: Trace, args, text_prompts=None, logprobs: bool = True) -> None:
    """A few requests so first-call costs (allocator, kernels) do not land in the first measured run; the
    peer gets the same, so that neither side's first search run pays for its start."""
    # no shared prefixes here: the measured runs start from an empty prefix cache
    wl = workload_of(replace(trace, sharing=None), args, 2.0, num_requests=4, seed=args.seed + 999)
    bench_once(
        url, wl, Slo(ttft_p99=1e9, tbt_p99=1e9), progress=False, text_prompts=text_prompts, logprobs=logprobs
    )


def search_target(
    name: str,
    url: str,
    trace: Trace,
    args,
    slos: list[float],
    slo: Slo,
    log,
    text_prompts=None,
    logprobs: bool = True,
) -> dict:
    """Capacity search against one server, for every TBT SLO, from one shared set of runs."""

    runs = 0

    def evaluate(qps: float) -> dict:
        nonlocal runs
        runs += 1
        wl = workload_of(trace, args, qps)
        if name != "peer":
            reset_prefix_cache(url)
        # A peer's prompt cache cannot be emptied: its text prompts are new words on every run instead.
        texts = replace(text_prompts, salt=runs) if text_prompts is not None else None
        t0 = time.time()
        s, records = bench_once(
            url,
            wl,
            slo,
            model=args.model_name,
            logprobs=logprobs,
            desc=f"{name} @ {qps:.3g} qps",
            text_prompts=texts,
        )
        s["wall_s"] = time.time() - t0
        s["attainment"] = {str(t): slo_attainment(records, slo.ttft_p99, t) for t in slos}
        att = ", ".join(f"{float(t) * 1e3:.0f} ms: {a:.0%}" for t, a in s["attainment"].items())
        log(
            f"  {name} @ {qps:.3g} QPS: P99 TBT {s['tbt_s']['p99']}, P50 sched {s['scheduling_delay_s']['p50']}, "
            f"P50 TTFT {s['ttft_s']['p50']}, ok {s['outcomes']['ok']}/{s['num_requests']}, attainment ({att}) "
            f"({s['wall_s']:.0f} s; {describe(s['host'])})"
        )
        return s

    search = CapacitySearch(
        evaluate,
        start_qps=args.start_qps,
        tolerance=args.tolerance,
        max_runs=args.max_runs,
        min_qps=args.min_qps,
    )
    passes = criterion(args)
    out = {}
    for tbt in sorted(slos, reverse=True):
        r = search.search(lambda s, t=tbt: passes(s, t))
        out[str(tbt)] = r.to_json()
        log(f"  {name}: capacity at P99 TBT <= {tbt * 1e3:.0f} ms: {r.capacity_qps:.3g} QPS {r.note}")
    for tbt in slos:  # every run informs every SLO: tighten each bracket with the later searches' runs
        lo, hi = search.bracket(lambda s, t=tbt: passes(s, t))
        out[str(tbt)].update(final_bracket=[lo, hi], capacity_qps=lo)
    return {"by_tbt_slo": out, "runs": {str(q): s for q, s in sorted(search.runs.items())}}


def criterion(args):
    """passes(summary, tbt_slo) under --capacity-definition: `paper` (P99 TBT over all gaps and P50
    scheduling delay) or `attainment` (>= --attainment of requests meet TTFT and their own P99 TBT)."""
    if getattr(args, "capacity_definition", "paper") == "attainment":
        return lambda s, t: meets_attainment(s, t, args.attainment)
    return lambda s, t: meets_capacity_slo(s, t, args.slo_delay)


def server_slo(server: ServerEntry, slos: list[float], slo: Slo) -> tuple[float, float] | None:
    """What a time-budgeted server is told: the strictest P99 TBT SLO searched and the TTFT SLO (a
    server with a token budget is told nothing)."""
    return None if server.time_target is None else (min(slos), slo.ttft_p99)


def simulated(
    server: ServerEntry, trace: Trace, args, slos: list[float], slo: Slo, caching: bool = True
) -> dict | None:
    if not args.cost_model:
        return None
    from stallfree.bench.simulate import contention_of, sim_config, simulate_capacity
    from stallfree.costmodel.fitted import FittedCostModel

    cost = FittedCostModel.load(args.cost_model)
    cfg = sim_config(args, server.policy, server.token_budget, contention_of(args.contention, cost), caching,
                     server.time_target, server_slo(server, slos, slo))  # fmt: skip
    return simulate_capacity(trace, args, cost, cfg, slos, slo)


def _plot(results: dict, slos: list[float], out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(results)
    width = 0.8 / len(slos)
    for k, t in enumerate(slos):
        vals = [results[n]["measured"]["by_tbt_slo"][str(t)]["capacity_qps"] for n in names]
        a1.bar([i + k * width for i in range(len(names))], vals, width, label=f"P99 TBT <= {t * 1e3:.0f} ms")
    a1.set_xticks([i + width * (len(slos) - 1) / 2 for i in range(len(names))], names)
    a1.set_ylabel("capacity, QPS")
    a1.set_title("Capacity under SLO (measured)")
    a1.legend(fontsize=8)
    for n in names:
        runs = sorted((float(q), s) for q, s in results[n]["measured"]["runs"].items())
        a2.plot(
            [q for q, _ in runs],
            [(s["tbt_s"]["p99"] or float("nan")) * 1e3 for _, s in runs],
            marker="o",
            label=n,
        )
    for t in slos:
        a2.axhline(t * 1e3, color="grey", ls="--", lw=0.8)
    a2.set_xlabel("QPS")
    a2.set_ylabel("P99 TBT, ms")
    a2.set_yscale("log")
    a2.set_title("P99 TBT of every run")
    a2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "capacity.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main_capacity(args: argparse.Namespace, trace: Trace, slos: list[float], slo: Slo) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        log_lines.append(msg)
        print(msg, file=sys.stderr, flush=True)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results: dict[str, dict] = {}
    t_start = time.time()
    for entry, caching in [(e, c) for e in policies for c in caching_modes(args)]:
        server = parse_server_entry(entry, args.token_budget)
        policy, budget = server.policy, server.token_budget
        entry = config_label(entry, caching)
        spec = ServerSpec(
            policy=policy,
            token_budget=budget,
            time_target=server.time_target,
            slo=server_slo(server, slos, slo),
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            chunk_align=args.chunk_align,
            chunk_context_scale=args.chunk_context_scale,
            model=args.model,
            load_format=args.load_format,
            threads=args.threads,
            extra_args=iteration_log_args(args.iteration_logs, out, entry),
            prefix_caching=caching,
        )
        mode = f"budget {budget}" if server.time_target is None else f"time target {server.time_target:g}"
        log(f"{entry}: starting stallfree serve ({mode}, {args.threads} thread(s))")
        with ServerProcess(spec, out / f"server-{entry.replace('@', '-')}.log") as server:
            warm_up(server.url, trace, args)
            results[entry] = {
                "measured": search_target(entry, server.url, trace, args, slos, slo, log),
                "server": spec.command(0),
                "token_budget": budget,
                "prefix_caching": caching,
            }
        results[entry]["simulated"] = simulated(server, trace, args, slos, slo, caching)
    if args.peer_url:
        log(f"peer {args.peer_url}")
        text_prompts = load_text_prompts() if args.peer_text_prompts else None
        warm_up(args.peer_url, trace, args, text_prompts=text_prompts, logprobs=not args.peer_no_logprobs)
        results["peer"] = {
            "measured": search_target(
                "peer",
                args.peer_url,
                trace,
                args,
                slos,
                slo,
                log,
                text_prompts=text_prompts,
                logprobs=not args.peer_no_logprobs,
            ),
            "url": args.peer_url,
        }
    wall = time.time() - t_start
    wl = workload_of(trace, args, 1.0).describe()
    path = write_json(
        out,
        "capacity.json",
        {"args": vars(args), "workload": wl, "wall_s": wall, "results": results, "log": log_lines},
    )
    png = _plot(results, slos, out)
    rows = []
    for name, r in results.items():
        row = [name]
        for t in slos:
            cap = r["measured"]["by_tbt_slo"][str(t)]["capacity_qps"]
            base = (
                results.get("vllm", {})
                .get("measured", {})
                .get("by_tbt_slo", {})
                .get(str(t), {})
                .get("capacity_qps")
            )
            ratio = f" ({cap / base:.1f}x vllm)" if base and name != "vllm" else ""
            sim = r.get("simulated")
            simv = f" [sim {sim['by_tbt_slo'][str(t)]['capacity_qps']:.3g}]" if sim else ""
            row.append(f"{cap:.3g}{ratio}{simv}")
        row.append(str(len(r["measured"]["runs"])))
        rows.append(row)
    print(
        table(
            ["server", *[f"capacity @ P99 TBT <= {t * 1e3:.0f} ms" for t in slos], "runs"],
            rows,
            title=(
                f"capacity (QPS) on {wl['trace']} x{args.scale:g} (median prompt {wl['prompt_tokens_median']:.0f}, output "
                f"{wl['output_tokens_median']:.0f}; {wl['num_clipped']} of {wl['num_requests']} clipped to "
                f"{args.max_model_len}), {args.num_requests} requests per run, seed {args.seed}, P50 scheduling delay <= "
                f"{args.slo_delay:g} s, budget {args.token_budget}; {wall / 60:.1f} min"
            ),
        )
    )
    print(f"saved {path} and {png}")
    return 0
