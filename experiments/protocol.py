"""The capacity protocol's workload for experiments that drive their own servers (warm_start, calibration):
the `stallfree bench capacity` options, so their requests are exactly the protocol's."""

from __future__ import annotations

import argparse

from stallfree.bench import cli as bench_cli
from stallfree.bench.simulate import load_workload_trace
from stallfree.bench.traces import Trace
from stallfree.engine.serve_cli import resolve_load_format


def add_protocol_args(ap: argparse.ArgumentParser) -> None:
    """The protocol's workload and SLO flags (docs/benchmarks.md §8), with its values as defaults."""
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=5.0, help="TTFT SLO, seconds (default %(default)s)")
    ap.add_argument("--slo-tbt", type=float, default=0.5, help="each request's P99 TBT SLO, seconds")


def protocol_workload(a: argparse.Namespace) -> tuple[argparse.Namespace, Trace, str | None, str]:
    """(the capacity command's arguments, its trace, the server's model and load format) from an
    experiment's --trace, --scale, --max-output-tokens, --num-requests and --threads."""
    flags = {
        "--trace": a.trace,
        "--scale": a.scale,
        "--max-output-tokens": a.max_output_tokens,
        "--num-requests": a.num_requests,
        "--threads": a.threads,
    }
    args = bench_cli.build_parser().parse_args(
        ["capacity", *(x for kv in flags.items() for x in map(str, kv))]
    )
    model, load_format = resolve_load_format(args.model, args.load_format, args.shape)
    return args, load_workload_trace(args), model, load_format
