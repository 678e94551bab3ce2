"""Scheduler cost per iteration, prefix caching on vs off, on the sharegpt capacity workload (no sharing).

    python -m experiments.prefix_cache_overhead > docs/figures/prefix-cache/scheduler-overhead.json

Prints JSON: CPU microseconds per simulated iteration (the simulator runs the real scheduler and block
manager; the difference between on and off is what prefix caching adds to scheduling). Run from the
repository root (it reads docs/figures/controller/cost_model.json)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from stallfree.bench.simulator import SimConfig, simulate
from stallfree.bench.traces import load_trace, make_workload
from stallfree.costmodel.fitted import FittedCostModel


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m experiments.prefix_cache_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    cost = FittedCostModel.load("docs/figures/controller/cost_model.json")
    wl = make_workload(load_trace("sharegpt"), 400, qps=5.0, scale=0.125, max_model_len=8192, seed=0)
    res: dict[bool, list[float]] = {True: [], False: []}
    iterations = 0
    for _ in range(5):
        for caching in (True, False):  # interleaved, so drift on a shared box hits both alike
            t0 = time.process_time()
            r = simulate(wl, cost, SimConfig(token_budget=256, enable_prefix_caching=caching))
            res[caching].append((time.process_time() - t0) / r.num_iterations * 1e6)
            iterations = r.num_iterations
    print(
        json.dumps(
            {
                "on_us": statistics.median(res[True]),
                "off_us": statistics.median(res[False]),
                "iterations": iterations,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
