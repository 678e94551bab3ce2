"""`stallfree bench {serve,capacity,sweep}`: load generation against real servers.

  serve     replay a trace against a running OpenAI-compatible server (open loop, Poisson, seeded)
  capacity  start one `stallfree serve` per policy and search each one's capacity under TBT SLOs
  sweep     fixed-load runs over policies and token budgets (ablation, budget sweep, simulator accuracy)

Trace lengths are multiplied by --scale and clipped to --max-model-len; every report says how many were
clipped. Named traces are read from the repository's data/traces/ (or $STALLFREE_TRACES).
"""

from __future__ import annotations

import argparse
import logging
import sys

from stallfree.bench import capacity_cmd, sweep_cmd
from stallfree.bench.simulate import (
    add_workload_args,
    caching_modes,
    load_workload_trace,
    tbt_slos,
    workload_of,
)
from stallfree.bench.simulator import POLICY_NAMES, parse_server_entry
from stallfree.engine.serve_cli import add_load_format_args, resolve_load_format
from stallfree.slo import Slo

SERVE_EXAMPLE = """\
example (CPU, SmolLM2-135M, summarization trace at 1/8 length):
  stallfree serve --port 8000 &
  stallfree bench serve --url http://127.0.0.1:8000 --trace arxiv --scale 0.125 --qps 1 \\
      --num-requests 50 --slo-ttft 10 --slo-tbt 0.5 --out results/bench-serve
"""
CAPACITY_EXAMPLE = """\
example:
  stallfree bench capacity --policies sarathi,vllm,orca --trace arxiv --scale 0.125 --num-requests 16 \\
      --slo-tbt 2.0,6.0 --token-budget 256 --start-qps 0.25 --tolerance 0.25 --max-runs 4 \\
      --cost-model results/profile/cost_model.json --out results/capacity
  (SLOs in seconds for a 2-core CPU; see docs/benchmarks.md for how they were derived)
"""
SWEEP_EXAMPLE = """\
examples:
  stallfree bench sweep --policies sarathi,sarathi-nohybrid,orca --qps 0.3 --scale 0.125 --out results/ablation
  stallfree bench sweep --policies sarathi --token-budgets 128,256,512,1024,2048 --qps 0.3 --scale 0.125 \\
      --out results/budgets
  stallfree bench sweep --policies sarathi,orca --shape llama3-8b --qps 2 --out results/sweep-8b   # GPU, random weights
"""


TEXT_PROMPTS_HELP = (
    "send prompts as text of the same token length (words of the bundled model's vocabulary; EOS banned "
    "with logit_bias) for servers that refuse token-id prompts, e.g. llama.cpp's"
)


def _server_args(ap: argparse.ArgumentParser) -> None:
    """Options of the `stallfree serve` processes that capacity and sweep start."""
    g = ap.add_argument_group("servers started by this command")
    g.add_argument("--model", default=None, help="model for stallfree serve (default: bundled SmolLM2-135M)")
    add_load_format_args(g)
    g.add_argument("--token-budget", type=int, default=512, help="sarathi's token budget")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: the server's)")
    g.add_argument("--chunk-align", type=int, default=0)
    g.add_argument(
        "--chunk-context-scale",
        type=int,
        default=None,
        metavar="C",
        help="the servers' --chunk-context-scale (sarathi: chunks charged for their context)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads per server (OMP_NUM_THREADS)")
    g.add_argument("--iteration-logs", action="store_true", help="each server writes iterations-NAME.jsonl "
                   "next to its log: fit a cost model to it with `stallfree profile --from-log`")  # fmt: skip
    g.add_argument(
        "--cost-model", default=None, help="also report the simulator's prediction (cost_model.json)"
    )
    g.add_argument("--overhead-ms", type=float, default=0.0, help="simulator: extra time per iteration")
    g.add_argument("--contention", default="1", help="simulator: multiply predicted iteration times; "
                   "'profile' = the factor measured while profiling")  # fmt: skip
    ap.set_defaults(model_name=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="stallfree bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{serve,capacity,sweep}")
    fmt = argparse.RawDescriptionHelpFormatter

    s = sub.add_parser(
        "serve",
        help="replay a trace against a running server",
        epilog=SERVE_EXAMPLE,
        description="Open-loop load generator for any OpenAI-compatible /v1/completions server.",
        formatter_class=fmt,
    )
    s.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add_workload_args(s)
    s.add_argument("--qps", type=float, default=None, help="Poisson arrival rate; omit to use the trace's own "
                   "arrival times (the file needs an arrived_at column)")  # fmt: skip
    s.add_argument("--model", dest="model_name", default=None, help="model id to send (default: /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer token for the server")
    s.add_argument("--traffic-cluster", default=None, help="send this x-traffic-cluster header")
    s.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a request counts as timed out"
    )
    s.add_argument("--no-logprobs", action="store_true", help="do not ask for logprobs (servers that lack them; "
                   "then tokens with empty text merge into the next chunk)")  # fmt: skip
    s.add_argument("--text-prompts", action="store_true", help=TEXT_PROMPTS_HELP)
    s.add_argument("--out", default="results/bench-serve")

    c = sub.add_parser(
        "capacity",
        help="capacity under SLOs, one server per policy",
        epilog=CAPACITY_EXAMPLE,
        description=capacity_cmd.__doc__,
        formatter_class=fmt,
    )
    c.add_argument(
        "--policies",
        default="sarathi,vllm,orca",
        help=f"comma list of {', '.join(POLICY_NAMES)}; "
        "POLICY@BUDGET overrides --token-budget for that entry (e.g. sarathi@256,sarathi@1024); sarathi@time "
        "(or sarathi@time0.7) budgets iterations in time, as `stallfree serve` does by default, and tells the "
        "server the strictest --slo-tbt and --slo-ttft as its SLOs",
    )
    c.add_argument("--peer-url", default=None, help="an external OpenAI-compatible server to search as well")
    c.add_argument("--peer-text-prompts", action="store_true", help=f"for the peer: {TEXT_PROMPTS_HELP}")
    c.add_argument("--peer-no-logprobs", action="store_true", help="for the peer: do not ask for logprobs")
    add_workload_args(c)
    _server_args(c)
    c.add_argument("--start-qps", type=float, default=0.5, help="first QPS of the search")
    c.add_argument(
        "--tolerance", type=float, default=0.1, help="stop bisecting at this relative bracket width"
    )
    c.add_argument("--max-runs", type=int, default=8, help="new runs per search at most")
    c.add_argument(
        "--min-qps", type=float, default=0.05, help="give up below this QPS (capacity reported as 0)"
    )
    c.add_argument("--capacity-definition", choices=("paper", "attainment"), default="paper", help="paper: "
                   "P99 TBT over all gaps <= SLO and P50 scheduling delay <= --slo-delay, every request served; "
                   "attainment: at least --attainment of the requests meet TTFT <= --slo-ttft and their own "
                   "P99 TBT <= SLO")  # fmt: skip
    c.add_argument("--attainment", type=float, default=0.9, help="share of requests for --capacity-definition "
                   "attainment (default 0.9)")  # fmt: skip
    c.add_argument("--out", default="results/capacity")

    w = sub.add_parser(
        "sweep",
        help="fixed-load runs over policies and budgets",
        epilog=SWEEP_EXAMPLE,
        description=sweep_cmd.__doc__,
        formatter_class=fmt,
    )
    w.add_argument("--policies", default="sarathi,sarathi-nohybrid,orca", help="comma list of policies")
    w.add_argument("--token-budgets", default="512", help="comma list of budgets (sarathi policies)")
    w.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate of every run")
    add_workload_args(w)
    _server_args(w)
    w.add_argument("--out", default="results/sweep")

    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # The arguments alone first, so a typo is reported before any file is read.
        slos = tbt_slos(args.slo_tbt)
        slo = Slo(ttft_p99=args.slo_ttft, tbt_p99=slos[0], scheduling_delay_p50=args.slo_delay)
        for p in (getattr(args, "policies", "") or "").split(","):
            if p.strip() and args.command == "capacity":
                parse_server_entry(p, args.token_budget)
            elif p.strip() and p.strip() not in POLICY_NAMES:
                raise ValueError(f"unknown policy {p.strip()!r}; choose from {', '.join(POLICY_NAMES)}")
        trace = load_workload_trace(args)
        caching_modes(args)
        if args.command in ("capacity", "sweep"):  # the servers' model, checked before any starts
            args.model, args.load_format = resolve_load_format(args.model, args.load_format, args.shape)
        if args.command == "serve":
            workload = workload_of(trace, args, args.qps)
    except ValueError as e:
        print(f"stallfree bench {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from stallfree.bench.serve_cmd import main_serve

        return main_serve(args, workload, slo)
    if args.command == "capacity":
        return capacity_cmd.main_capacity(args, trace, slos, slo)
    return sweep_cmd.main_sweep(args, trace, slo)


if __name__ == "__main__":
    raise SystemExit(main())
