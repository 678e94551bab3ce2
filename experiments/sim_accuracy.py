"""The simulator against a measured capacity run, run by run.

    python -m experiments.sim_accuracy CAPACITY.json --cost-model cost_model.json --out DIR

Reads the capacity.json of a `stallfree bench capacity` run and simulates every measured run again (same
trace, scale, requests, seed, arrivals, policy and budget) with a cost model: P99 TBT, P50 scheduling delay
and P50 TTFT, measured vs predicted, and each server's capacity per SLO, the measured bracket (largest
passing, smallest failing QPS) vs a finer simulated search. The peer (an external server) is skipped: the
simulator only knows stallfree's policies.

Output (--out): accuracy.json, and a table per metric in the terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from stallfree.bench.report import table, write_json
from stallfree.bench.simulate import _simulate_once, sim_config, simulate_capacity
from stallfree.bench.simulator import parse_policy_entry
from stallfree.bench.traces import load_trace
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.slo import Slo


def _err(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or measured <= 0:
        return None
    return predicted / measured - 1


def compare(
    capacity: dict,
    cost: FittedCostModel,
    contention: float = 1.0,
    tolerance: float = 0.05,
    servers: Collection[str] | None = None,
) -> dict:
    """Measured vs simulated, for every stallfree server in a capacity.json document (or only `servers`)."""
    a = SimpleNamespace(**capacity["args"])
    a.tolerance = tolerance  # the simulated search is finer than the measured one
    trace = load_trace(a.trace)
    slos = sorted(float(t) for t in next(iter(capacity["results"].values()))["measured"]["by_tbt_slo"])
    slo = Slo(ttft_p99=a.slo_ttft, tbt_p99=min(slos), scheduling_delay_p50=a.slo_delay)
    out: dict = {"runs": [], "capacity": [], "contention": contention, "tolerance": tolerance}
    for name, r in capacity["results"].items():
        if name == "peer" or "server" not in r or (servers is not None and name not in servers):
            continue
        policy, budget = parse_policy_entry(name, a.token_budget)
        cfg = sim_config(a, policy, budget, contention)
        for q, m in sorted(r["measured"]["runs"].items(), key=lambda kv: float(kv[0])):
            p = _simulate_once(trace, a, cost, cfg, float(q), slo)
            row = {"server": name, "qps": float(q)}
            for key, stat in (
                ("tbt_s", "p99"),
                ("tbt_s", "p50"),
                ("scheduling_delay_s", "p50"),
                ("ttft_s", "p50"),
            ):
                mv, pv = m[key][stat], p[key][stat]
                row[f"{key}.{stat}"] = {"measured": mv, "predicted": pv, "error": _err(mv, pv)}
            out["runs"].append(row)
        sim = simulate_capacity(trace, a, cost, cfg, slos, slo)
        for t in slos:
            meas = r["measured"]["by_tbt_slo"][str(t)]
            lo, hi = meas.get("final_bracket") or [meas["capacity_qps"], None]
            pred = sim["by_tbt_slo"][str(t)]["capacity_qps"]
            mid = (lo + hi) / 2 if hi is not None else None
            out["capacity"].append(
                {
                    "server": name,
                    "tbt_slo": t,
                    "measured_bracket": [lo, hi],
                    "predicted": pred,
                    "error_vs_midpoint": _err(mid, pred),
                    "inside_bracket": lo <= pred and (hi is None or pred < hi),
                }
            )
    errs = [abs(r["tbt_s.p99"]["error"]) for r in out["runs"] if r["tbt_s.p99"]["error"] is not None]
    out["p99_tbt_summary"] = {
        "runs": len(errs),
        "within_20pct": int(sum(e <= 0.2 for e in errs)),
        "median_abs_error": float(np.median(errs)) if errs else None,
    }
    return out


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.0%}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.sim_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("capacity", help="capacity.json of a `stallfree bench capacity` run")
    ap.add_argument("--cost-model", required=True, help="cost_model.json from `stallfree profile`")
    ap.add_argument("--contention", type=float, default=1.0, help="multiply predicted iteration times")
    ap.add_argument("--tolerance", type=float, default=0.05, help="simulated capacity search's bracket width")
    ap.add_argument("--out", default="results/accuracy")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        capacity = json.loads(Path(args.capacity).read_text())
        cost = FittedCostModel.load(args.cost_model)
    except (OSError, ValueError) as e:
        print(f"experiments.sim_accuracy: {e}", file=sys.stderr)
        return 2
    res = compare(capacity, cost, args.contention, args.tolerance)
    rows = [
        [r["server"], f"{r['qps']:.3g}"]
        + [
            f"{r[k]['measured']:.3f} / {r[k]['predicted']:.3f} ({_pct(r[k]['error'])})"
            if r[k]["measured"] is not None and r[k]["predicted"] is not None
            else "-"
            for k in ("tbt_s.p99", "tbt_s.p50", "scheduling_delay_s.p50", "ttft_s.p50")
        ]
        for r in res["runs"]
    ]
    print(table(["server", "QPS", "P99 TBT s", "P50 TBT s", "P50 sched s", "P50 TTFT s"], rows,
                title="measured / predicted (error)"))  # fmt: skip
    s = res["p99_tbt_summary"]
    if s["runs"]:
        print(
            f"P99 TBT: {s['within_20pct']} of {s['runs']} runs within 20%, median |error| {s['median_abs_error']:.0%}"
        )
    cap_rows = [
        [c["server"], f"{c['tbt_slo']:g}", f"{c['measured_bracket'][0]:.3g} - "
         f"{'?' if c['measured_bracket'][1] is None else format(c['measured_bracket'][1], '.3g')}",
         f"{c['predicted']:.3g}", _pct(c["error_vs_midpoint"]), "yes" if c["inside_bracket"] else "no"]
        for c in res["capacity"]
    ]  # fmt: skip
    print(table(["server", "TBT SLO s", "measured QPS", "predicted", "vs midpoint", "inside"], cap_rows,
                title="capacity"))  # fmt: skip
    path = write_json(Path(args.out), "accuracy.json", res)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
