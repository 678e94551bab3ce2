"""Live validation of a simulated capacity study: real servers at QPS points bracketing the simulated capacity.

Reads the live plan that `python -m experiments.capacity_study` wrote (capacity_study.json: per server a policy, a
budget and two QPS points around its simulated capacity at the strict SLO), and for each server:
starts `stallfree serve` (--device, --shape: random weights of a named shape), warms it up, replays the
trace at each point (`stallfree bench serve`'s load generator: Poisson arrivals, outputs of the trace's
lengths with ignore_eos), and simulates the SAME requests and arrivals on the cost model with the same
server knobs. A point agrees when live and simulation give the same verdict under the capacity criterion
(P99 TBT <= SLO, P50 scheduling delay <= 2 s, every request served) and the live P99 TBT is within
--tbt-tolerance of the simulated one.

Run on the GPU machine by scripts/gpu-capacity; `--device cpu --shape tiny-hd128 --scale 0.01 --qps ...`
checks the plumbing end to end without a GPU (its verdicts mean nothing: the cost model is the GPU's).

Output (--out): live_check.json, one server log per server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.capacity_study import compact
from stallfree.bench.launcher import ServerProcess, ServerSpec
from stallfree.bench.metrics import meets_capacity_slo, summarize
from stallfree.bench.report import table, write_json
from stallfree.bench.serve_cmd import bench_once
from stallfree.bench.simulator import SimConfig, simulate
from stallfree.bench.traces import load_trace, make_workload
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.slo import Slo


def point_verdict(live: dict, sim: dict, tbt_slo: float, delay_slo: float, tolerance: float) -> dict:
    """Whether a live run and its simulation agree: same pass/fail, P99 TBT within `tolerance`."""
    live_ok = meets_capacity_slo(live, tbt_slo, delay_slo)
    sim_ok = meets_capacity_slo(sim, tbt_slo, delay_slo)
    lt, st = live["tbt_s"]["p99"], sim["tbt_s"]["p99"]
    rel = (lt - st) / st if lt is not None and st else None
    return {
        "live_meets": live_ok,
        "simulated_meets": sim_ok,
        "pass_fail_agrees": live_ok == sim_ok,
        "tbt_p99_rel_err": rel,
        "tbt_within_tolerance": rel is not None and abs(rel) <= tolerance,
    }


def _points(plan: dict, qps_override: list[float] | None) -> list[tuple[str, dict, float]]:
    out = []
    for label, s in plan["servers"].items():
        for q in qps_override or s["qps"]:
            out.append((label, s, float(q)))
    return out


class _Run:
    """What every server of one live check shares: the plan, the trace, the cost model, the clock."""

    def __init__(self, args, plan: dict, trace, cost: FittedCostModel, blocks: int, block: int, t0: float):
        self.args, self.plan, self.trace, self.cost = args, plan, trace, cost
        self.blocks, self.block, self.t0 = blocks, block, t0
        self.slo = Slo(
            ttft_p99=1e9, tbt_p99=plan["tbt_slo_s"], scheduling_delay_p50=plan["scheduling_delay_slo_s"]
        )

    def log(self, msg: str) -> None:
        print(f"[live_check {time.monotonic() - self.t0:5.0f}s] {msg}", file=sys.stderr, flush=True)

    def workload(self, n: int, qps: float, seed: int):
        return make_workload(self.trace, n, qps=qps, scale=self.args.scale,
                             max_model_len=self.plan["max_model_len"], seed=seed)  # fmt: skip

    def server(self, label: str, qs: list[float]) -> list[dict]:
        """Start one server, warm it up, run its points."""
        s, plan, a = self.plan["servers"][label], self.plan, self.args
        cfg = SimConfig(policy=s["policy"], token_budget=s["token_budget"], max_num_seqs=plan["max_num_seqs"],
                        num_kv_blocks=self.blocks, block_size=self.block, max_model_len=plan["max_model_len"])  # fmt: skip
        spec = ServerSpec(policy=s["policy"], token_budget=s["token_budget"], max_num_seqs=plan["max_num_seqs"],
                          num_kv_blocks=self.blocks, threads=a.threads,
                          extra_args=["--device", a.device, "--shape", a.shape, "--block-size", str(self.block),
                                      "--max-model-len", str(plan["max_model_len"])])  # fmt: skip
        self.log(f"{label}: starting stallfree serve ({' '.join(spec.command(0)[3:])})")
        log_path = Path(a.out) / f"server-{label.replace('@', '-')}.log"
        with ServerProcess(spec, log_path, ready_timeout=600) as server:
            self.log(f"{label}: ready; warming up")
            bench_once(
                server.url,
                self.workload(4, 2.0, a.seed + 999),
                Slo(ttft_p99=1e9, tbt_p99=1e9),
                progress=False,
            )
            return [self.point(server.url, label, s, cfg, q) for q in qs]

    def point(self, url: str, label: str, s: dict, cfg: SimConfig, q: float) -> dict:
        """One QPS point: simulate it, run it live (unless it would pass the deadline), compare."""
        a = self.args
        wl = self.workload(a.num_requests, q, a.seed)
        res = simulate(wl, self.cost, cfg)
        sim = summarize(res.records, self.slo)
        sim["num_preemptions"] = res.num_preemptions
        row = {"server": label, "policy": s["policy"], "token_budget": s["token_budget"], "qps": q}
        if time.monotonic() - self.t0 + sim["makespan_s"] * 1.2 + 10 > a.deadline:
            self.log(f"{label} @ {q:g} QPS: skipped (would end past the {a.deadline:g} s deadline)")
            return {**row, "skipped": True, "simulated": compact(sim)}
        t0 = time.monotonic()
        live, records = bench_once(url, wl, self.slo, desc=f"{label} @ {q:g} qps")
        v = point_verdict(live, sim, self.slo.tbt_p99, self.slo.scheduling_delay_p50, a.tbt_tolerance)
        self.log(f"{label} @ {q:g} QPS: live P99 TBT {_ms(live['tbt_s']['p99'])} / sim {_ms(sim['tbt_s']['p99'])} ms, "
                 f"P50 sched {_s(live['scheduling_delay_s']['p50'])} / {_s(sim['scheduling_delay_s']['p50'])} s; "
                 f"meets {v['live_meets']} / {v['simulated_meets']}")  # fmt: skip
        return {**row, "wall_s": time.monotonic() - t0, "live": compact(live), "simulated": compact(sim),
                "scheduling_delay_source": live["scheduling_delay_source"],
                "errors": sorted({r.error for r in records if r.error})[:3], **v}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.live_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--study", default="docs/figures/gpu/capacity_study.json", help="capacity-study output")
    ap.add_argument("--cost-model", default=None, help="default: the study's cost model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama3-8b", help="random-weight model shape for stallfree serve")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per point (default: the plan's)")
    ap.add_argument("--scale", type=float, default=1.0, help="trace length multiplier (dry runs on a CPU)")
    ap.add_argument("--qps", default=None, help="comma list overriding every server's QPS points")
    ap.add_argument("--seed", type=int, default=None, help="seed of the requests (default: the plan's)")
    ap.add_argument("--max-kv-gb", type=float, default=90.0, help="cap the KV cache at this (GB); the "
                    "simulation is given the same number of blocks")  # fmt: skip
    ap.add_argument("--tbt-tolerance", type=float, default=0.2, help="live vs simulated P99 TBT")
    ap.add_argument("--kv-bytes-per-token", type=int, default=None, help="default: the study's")
    ap.add_argument("--deadline", type=float, default=540.0, help="skip points that would end after this "
                    "many seconds from the start (predicted by the simulation)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=4, help="torch CPU threads per server")
    ap.add_argument("--out", default="results/live-check")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    try:
        study = json.loads(Path(args.study).read_text())
        plan = study["live_plan"]
        cost_path = args.cost_model or study["cost_model"]["path"]
        cost = FittedCostModel.load(cost_path)
        trace = load_trace(plan["trace"])
        qps_override = [float(q) for q in args.qps.split(",")] if args.qps else None
    except (OSError, KeyError, ValueError) as e:
        print(f"live_check: {e}", file=sys.stderr)
        return 2
    args.num_requests = args.num_requests or plan.get("num_requests", 200)
    args.seed = plan.get("seed", 0) if args.seed is None else args.seed
    per_token = args.kv_bytes_per_token or study["args"]["kv_bytes_per_token"]
    block = study["kv_cache"]["block_size"]
    blocks = min(plan["num_kv_blocks"], int(args.max_kv_gb * 1e9 // (per_token * block)))
    run = _Run(args, plan, trace, cost, blocks, block, t_start)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    by_server: dict[str, list[float]] = {}
    for label, _, q in _points(plan, qps_override):
        by_server.setdefault(label, []).append(q)
    rows: list[dict] = []
    for label, qs in by_server.items():
        try:
            rows += run.server(label, qs)
        except RuntimeError as e:  # the server did not start (or died): say so, go on with the next
            run.log(f"{label}: {e}")
            rows += [{"server": label, "qps": q, "skipped": True, "error": str(e)[-2000:]} for q in qs]
    tbt_slo, delay_slo = plan["tbt_slo_s"], plan["scheduling_delay_slo_s"]
    done = [r for r in rows if not r.get("skipped")]
    verdict = {
        "points": len(rows),
        "measured": len(done),
        "pass_fail_agree": sum(r["pass_fail_agrees"] for r in done),
        "tbt_within_tolerance": sum(r["tbt_within_tolerance"] for r in done),
        "both": sum(r["pass_fail_agrees"] and r["tbt_within_tolerance"] for r in done),
    }
    doc = {"description": __doc__.split("\n")[0], "study": args.study, "cost_model": cost_path, "args": vars(args),
           "num_kv_blocks": blocks, "tbt_slo_s": tbt_slo, "scheduling_delay_slo_s": delay_slo, "trace": plan["trace"],
           "rows": rows, "verdict": verdict, "wall_s": time.monotonic() - t_start}  # fmt: skip
    path = write_json(Path(args.out), "live_check.json", doc)
    _print(rows, verdict, plan, args)
    print(f"saved {path}")
    return 0 if verdict["both"] == verdict["points"] else 1


def _print(rows: list[dict], verdict: dict, plan: dict, args) -> None:
    def cells(r: dict) -> list[str]:
        live, sim = r.get("live") or {}, r.get("simulated") or {}
        agree = (
            "-"
            if r.get("skipped")
            else ("yes" if r["pass_fail_agrees"] and r["tbt_within_tolerance"] else "no")
        )
        return [r["server"], f"{r['qps']:g}", _ms(live.get("tbt_p99_s")), _ms(sim.get("tbt_p99_s")),
                _pct(r.get("tbt_p99_rel_err")), _s(live.get("scheduling_delay_p50_s")),
                _s(sim.get("scheduling_delay_p50_s")), str(r.get("live_meets", "skipped")),
                str(r.get("simulated_meets", "-")), agree]  # fmt: skip

    print(table(["server", "QPS", "live P99 TBT ms", "sim P99 TBT ms", "TBT err", "live P50 sched s",
                 "sim P50 sched s", "live meets", "sim meets", "agree"], [cells(r) for r in rows],
                title=f"live vs simulated, {plan['trace']} x{args.scale:g}, {args.num_requests} requests per point, "
                f"strict SLO {plan['tbt_slo_s'] * 1e3:.0f} ms, {args.device} {args.shape}"))  # fmt: skip
    print(f"\npass/fail agrees at {verdict['pass_fail_agree']} of {verdict['measured']} measured points "
          f"({verdict['points']} planned); P99 TBT within {args.tbt_tolerance:.0%} at {verdict['tbt_within_tolerance']}; "
          f"both at {verdict['both']}")  # fmt: skip


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    raise SystemExit(main())
