"""Adaptive budget vs every static budget on a phase-shifting workload, against a REAL local deployment.

    python -m experiments.phase.live --out DIR [--budgets 128,512,2048] [--phases ...] [--rounds N]

The live counterpart of phase.sim (the simulator). The workload is the same (its build_workload:
Poisson chat requests with ShareGPT lengths and summarization requests with arXiv lengths, CPU-scaled, at
each phase's rates). Each run starts ONE deployment the product way, `stallfree up FILE` on the bundled
model, from a generated SarathiDeployment file (kept in DIR/specs/), replays the workload over HTTP, and
stops it (SIGTERM) before the next run starts:

  static B   budget.initial = B, controller.enabled = false: the budget and chunk caps stay at B
             (chunk caps no lower than the budget: what serving stacks do today)
  adaptive   what a user gets by default with the controller on (--adaptive time, the default):
             budget.mode = time, each iteration's prefill sized by the engine's calibrated cost model to
             fit --time-target x the strictest P99 TBT SLO among the clusters decoding in it, up to
             --time-cap tokens (also the clusters' chunkCap), and local mode's control loop (the real
             decide()) tuning the target and admission. --adaptive tokens: budget.initial = --initial,
             and the loop retunes the token budget within [min, max] of --budgets, and the chunk caps
             with it. Either way every --interval seconds from the engines' P99s over --window seconds

Otherwise every run's spec is the same: one replica, policy sarathi, traffic clusters chat (priority 10) and
summarization (priority 0) chosen by the x-traffic-cluster header alone, with the SLOs given below, and
chunkCap = the largest budget (a ceiling only; the caps follow the budget).

Requests go out open loop at their arrival times through the load generator of `stallfree bench serve`
(streamed completions of fixed length, one SSE chunk per token), each with its cluster's header. A request
is good, exactly as in phase.sim.meets, when it completed, its TTFT (first token - send) is within
its cluster's TTFT SLO and the P99 of its own inter-token gaps is within its TBT SLO; rejected (429),
failed and timed-out requests are never good. Goodput = good requests per second of phase; the per-phase
oracle takes the best static budget separately in each phase.

During every run GET /admin/v1/status is polled (--interval / 2, at most 1 s apart); each new controller
decision becomes one timeline point {t, budget, tbt_p99 per cluster (the controller's own windowed view)},
and recovery after each phase change is counted in control intervals (phase.sim.recovery_intervals).
The same count is also taken from the gaps the client saw (`client_recovery_intervals`, every run).

Writes to --out: results.json (rewritten after every run), phase_live.png, records-<run>.json (every
request as the load generator saw it), specs/<run>.yaml and logs/<run>.log (`stallfree up`'s output).
Prints a table. The load average before and after each run is recorded: keep the machine quiet.

Each cluster's scheduling-delay SLO (P50) is set to its TTFT SLO, as in phase.sim. A run takes the
deployment's start-up (model load), phases x --phase-seconds, and the tail of the last requests; they run
one after another: static budgets in increasing order, then adaptive.

--rounds N runs that set N times (odd rounds in that order, even rounds backward), each round a complete
run in DIR/round-K/, and writes DIR/rounds.json, rounds.png and a table of each round's ratios and their
medians (phase.rounds): on a shared box one run per configuration cannot tell the controller from drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import yaml

from experiments.phase import rounds
from experiments.phase.sim import (
    Rec,
    Req,
    build_workload,
    client_timeline,
    cluster_figures,
    parse_phases,
    plot,
    recovery_intervals,
    score,
    violation_episodes,
)
from stallfree.bench.host import HostWatch
from stallfree.bench.loadgen import fetch_model_id, run_workload
from stallfree.bench.metrics import OK, OUTCOMES, RequestRecord
from stallfree.bench.traces import TraceRequest, Workload
from stallfree.operator.controller.types import ClusterSpec
from stallfree.operator.spec import API_VERSION, KIND
from stallfree.ports import free_port
from stallfree.slo import Slo

MODEL = "SmolLM2-135M-Instruct"  # the bundled model: nothing to download


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """What every run's SarathiDeployment shares (built once from the flags)."""

    specs: tuple[ClusterSpec, ...]
    budgets: tuple[int, ...]
    initial: int
    interval_s: int
    window_s: int
    max_num_seqs: int = 64
    adaptive_mode: str = "time"  # "time": budget.mode time with the controller; "tokens": the token loop
    time_target: float = 0.8
    time_cap: int = 2048


# ---- the SarathiDeployment of one run (pure) --------------------------------------------------------------


def deployment(cfg: LiveConfig, static_budget: int | None) -> dict:
    """The SarathiDeployment for one run: static at `static_budget` (controller off), adaptive when None."""
    lo, hi = min(cfg.budgets), max(cfg.budgets)
    timed = static_budget is None and cfg.adaptive_mode == "time"
    if timed:  # the cap bounds every chunk; the clusters' caps must not undercut it
        hi = max(hi, cfg.time_cap)
        budget = {"mode": "time", "timeTarget": cfg.time_target, "min": lo, "max": hi, "align": 32}
    else:
        budget = {"initial": cfg.initial if static_budget is None else static_budget, "min": lo, "max": hi,
                  "align": 32}  # fmt: skip

    clusters = [
        # Header only: no prompt-length rule, so the request's header alone decides its cluster.
        {
            "name": s.name,
            "match": {"header": s.name},
            "slo": s.slo.to_json(),
            "chunkCap": hi,
            "priority": s.priority,
        }
        for s in cfg.specs
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "phase-live"},
        "spec": {
            "model": {"name": MODEL, "maxModelLen": 8192},
            "replicas": {"min": 1, "max": 1},
            "resources": {"gpusPerPod": 0},
            "engine": {"policy": "sarathi", "blockSize": 16, "maxNumSeqs": cfg.max_num_seqs},
            "slo": cfg.specs[0].slo.to_json(),
            "budget": budget,
            "trafficClusters": clusters,
            "controller": {
                "enabled": static_budget is None,
                "intervalSeconds": cfg.interval_s,
                "windowSeconds": cfg.window_s,
            },
        },
    }


def validate_deployment(doc: dict) -> dict:
    """The check `stallfree up` runs on its file (stallfree.local.config.validate: CRD schema with its
    defaults, unknown fields, cross-field rules); raises ValueError (LocalConfigError) naming the field."""
    from stallfree.local.config import validate

    return validate(doc)


# ---- one `stallfree up` process ------------------------------------------------------------------------


@contextmanager
def local_deployment(
    file: Path, log_path: Path, *, port: int, threads: int, cost_model: str | None, ready_timeout: float
) -> Iterator[str]:
    """Run `stallfree up FILE` until the block ends; yields its base URL once /ready answers 200.
    Stops it with SIGTERM (it stops its engines first), SIGKILL after 60 s."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "stallfree", "up", str(file), "--port", str(port), "--no-view"]
    if cost_model:
        cmd += ["--cost-model", cost_model]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the engines inherit it
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"stallfree up exited ({proc.returncode}); {log_path}:\n{_tail(log_path)}")
            with suppress(httpx.HTTPError):
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"stallfree up not ready after {ready_timeout:g} s; {log_path}:\n"
                                   f"{_tail(log_path)}{_replica_tails(log_path)}")  # fmt: skip
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its engines get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                proc.wait()


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _replica_tails(up_log: Path) -> str:
    """The ends of the engine replicas' logs, found through the folder `stallfree up` printed."""
    m = re.search(r"logs in (\S+)", up_log.read_text(errors="replace"))
    if not m:
        return ""
    return "".join(f"\n--- {p}:\n{_tail(p)}" for p in sorted(Path(m.group(1)).glob("replica-*.log")))


class StatusPoller:
    """Polls GET /admin/v1/status; one timeline point per new controller decision (its lastDecisionTime),
    so every control interval counts once. `t` is when the poll saw it, seconds since `t0`."""

    def __init__(self, base: str, clusters: Sequence[str], period: float, t0: float) -> None:
        self.url, self.clusters, self.period, self.t0 = f"{base}/admin/v1/status", list(clusters), period, t0
        self.timeline: list[dict] = []
        self.budgets_seen: set[int] = set()
        self.errors = 0
        self._last: str | None = None

    def observe(self, doc: dict, t: float) -> None:
        budget = doc.get("budget") or {}
        if budget.get("tokenBudget") is not None:
            self.budgets_seen.add(int(budget["tokenBudget"]))
        when = budget.get("lastDecisionTime")
        if when is None or when == self._last:  # no decision yet (controller off), or seen already
            return
        self._last = when
        obs = {c.get("name"): c.get("observedTbtP99Seconds") for c in doc.get("trafficClusters") or []}
        self.timeline.append({"t": t, "budget": budget.get("tokenBudget"),
                              "tbt_p99": {n: obs.get(n) for n in self.clusters},
                              "action": budget.get("lastDecision"), "reason": budget.get("reason")})  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while not stop.is_set():
                try:
                    r = await client.get(self.url)
                    r.raise_for_status()
                    self.observe(r.json(), time.perf_counter() - self.t0)
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.period)


async def replay(
    base: str, reqs: Sequence[Req], desc: str, poll_s: float, timeout: float, seed: int
) -> tuple[list[RequestRecord], StatusPoller]:
    """Send every request at its arrival time with its cluster's header, polling the status meanwhile."""
    from tqdm import tqdm

    trace = tuple(TraceRequest(r.index, r.prompt, r.output, r.arrival, r.cluster) for r in reqs)
    wl = Workload("phase-live", 1.0, 8192, seed, None, trace, 0)
    async with httpx.AsyncClient(timeout=10.0) as c:
        model = await fetch_model_id(c, base)
    bar = tqdm(total=len(reqs), desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
    counts: Counter[str] = Counter()

    def done(rec: RequestRecord) -> None:
        counts[rec.outcome] += 1
        bar.set_postfix(counts, refresh=False)
        bar.update()

    stop = asyncio.Event()
    # NOTE: run_workload takes its own time zero a few ms later (after building the prompts): the timeline's
    # t is that much early, far below one control interval.
    poller = StatusPoller(base, sorted({r.cluster for r in reqs}), poll_s, time.perf_counter())
    task = asyncio.create_task(poller.run(stop))
    try:
        records = await run_workload(base, wl, model=model, timeout=timeout, on_done=done)
    finally:
        stop.set()
        await task
        bar.close()
    return records, poller


# ---- scoring (phase.sim's rule) -----------------------------------------------------------------


def to_recs(records: Sequence[RequestRecord], reqs: Sequence[Req]) -> list[Rec]:
    """phase.sim's per-request view of what the load generator saw: done = outcome ok (a rejected,
    failed or timed-out request is not), first token and every token's arrival time.

    NOTE: times are shifted back by the request's send lag (sent - due), so TTFT counts from when it really
    left the client (as `bench serve` does) while its phase stays the one it was due in. Gaps are unchanged."""
    out = []
    for rec, req in zip(records, reqs, strict=True):
        if rec.index != req.index:
            raise ValueError(f"record {rec.index} does not belong to request {req.index}")
        lag = rec.sent - req.arrival if rec.sent is not None else 0.0
        first = rec.first_token - lag if rec.first_token is not None else None
        out.append(Rec(req, first, tokens=[t - lag for t in rec.token_times], done=rec.outcome == OK))
    return out


def judge(
    records: Sequence[RequestRecord],
    reqs: Sequence[Req],
    specs: Sequence[ClusterSpec],
    starts: list[float],
    phase_s: float,
    step: float,
    window: float,
) -> dict:
    """phase.sim.score of one run, plus per-phase attainment, outcomes, send lag and client recovery."""
    recs = to_recs(records, reqs)
    sc = score(recs, specs, starts, phase_s)
    for p in sc["phases"]:
        p["attainment"] = p["good"] / max(p["requests"], 1)
    sc["outcomes"] = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    lags = [r.sent - r.arrival for r in records if r.sent is not None]
    sc["send_lag_s"] = {"p50": float(np.median(lags)), "max": float(max(lags))} if lags else None
    names = [s.name for s in specs]
    tl = client_timeline(recs, names, step, window)
    sc["client_recovery_intervals"] = recovery_intervals(tl, starts, specs, step)
    sc["client_timeline"] = tl
    # As phase.sim: each interval's own P99 (gaps that ended in it), without a window's memory.
    own = client_timeline(recs, names, step, step)
    sc["interval_recovery_intervals"] = recovery_intervals(own, starts, specs, step)
    sc["interval_violation_episodes"] = violation_episodes(own, specs, step)
    sc["clusters"] = cluster_figures(recs, specs)
    return sc


def request_timeout(reqs: Sequence[Req], specs: Sequence[ClusterSpec]) -> float:
    """Client timeout per request, long enough never to change a score: a request that can still meet its
    SLOs ends within TTFT SLO + (output - 1) x TBT SLO (the P99 of at most 100 gaps bounds their sum so;
    the workload caps outputs at 64), plus margin."""
    slo = {s.name: s.slo for s in specs}
    return max(slo[r.cluster].ttft_p99 + (r.output + 2) * slo[r.cluster].tbt_p99 for r in reqs) + 30.0


# ---- one run, and the experiment -------------------------------------------------------------------------


def run_one(
    name: str, doc: dict, reqs: Sequence[Req], a: argparse.Namespace, out: Path, timeout: float
) -> tuple[list[RequestRecord], dict]:
    """Start the deployment of `doc`, replay `reqs` against it, stop it. Returns the records and what was
    seen around them (load average, startup and replay seconds, status timeline, budgets seen)."""
    file = out / "specs" / f"{name}.yaml"
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    info: dict = {"loadavg_before": os.getloadavg()}
    host = HostWatch()
    print(f"{name}: starting stallfree up {file} ...", file=sys.stderr, flush=True)
    t = time.monotonic()
    with local_deployment(file, out / "logs" / f"{name}.log", port=a.port, threads=a.threads,
                          cost_model=a.cost_model, ready_timeout=a.ready_timeout) as base:  # fmt: skip
        info["startup_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        poll_s = min(1.0, a.interval / 2)
        records, poller = asyncio.run(replay(base, reqs, name, poll_s, timeout, a.seed))
        info["replay_s"] = round(time.monotonic() - t, 1)
        info["loadavg_after"] = os.getloadavg()
        info["host"] = host.summary()
    info.update(timeline=poller.timeline, budgets_seen=sorted(poller.budgets_seen),
                status_poll_errors=poller.errors)  # fmt: skip
    (out / f"records-{name}.json").write_text(json.dumps([r.to_json() for r in records]))
    return records, info


def summarize(results: dict, budgets: Sequence[int], n_phases: int, phase_s: float) -> dict:
    """Best static, per-phase oracle and the adaptive run's ratios to both (as phase.sim)."""
    static, ad = results["static"], results["adaptive"]
    best = max(budgets, key=lambda b: static[b]["goodput"])
    good = np.array([[p["good"] for p in static[b]["phases"]] for b in budgets])  # (budgets, phases)
    per_phase_best = [budgets[int(j)] for j in good.argmax(axis=0)]  # ties: the smaller budget, as max()
    oracle = float(good.max(axis=0).sum()) / (phase_s * n_phases)
    ceiling = results["num_requests"] / (phase_s * n_phases)  # every request good: no policy does better
    return {
        "best_static_budget": best,
        "best_static_goodput": static[best]["goodput"],
        "adaptive_goodput": ad["goodput"],
        "oracle_goodput": oracle,
        "oracle_budgets": per_phase_best,
        "adaptive_vs_best_static": ad["goodput"] / max(static[best]["goodput"], 1e-9),
        "adaptive_vs_oracle": ad["goodput"] / max(oracle, 1e-9),
        "ceiling_goodput": ceiling,
        "ceiling_vs_best_static": ceiling / max(static[best]["goodput"], 1e-9),
        "recovery_intervals": ad["recovery_intervals"],
        "client_recovery_intervals": ad["client_recovery_intervals"],
        "interval_recovery_intervals": ad.get("interval_recovery_intervals"),
        "best_static_client_recovery_intervals": static[best]["client_recovery_intervals"],
        "best_static_interval_recovery_intervals": static[best].get("interval_recovery_intervals"),
        # How long each violation lasted from its own start, wherever it fell (phase.sim).
        "violation_episodes": ad.get("violation_episodes"),
        "interval_violation_episodes": ad.get("interval_violation_episodes"),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.phase.live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--out", required=True, help="folder for results.json, phase_live.png, records, specs, logs"
    )
    p.add_argument("--budgets", default="128,512,2048",
                   help="static token budgets, comma-separated multiples of 32; their min and max bound the "
                   "adaptive run (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--initial", type=int, default=512, help="adaptive run's starting budget (default %(default)s)"
    )
    p.add_argument("--adaptive", choices=("time", "tokens"), default="time",
                   help="the adaptive run: `time` (budget.mode time with the controller on, the product's "
                   "default) or `tokens` (the controller retuning one token budget) (default %(default)s)")  # fmt: skip
    p.add_argument("--time-target", type=float, default=0.8,
                   help="budget.timeTarget of the --adaptive time run (default %(default)s)")  # fmt: skip
    p.add_argument("--time-cap", type=int, default=2048,
                   help="budget.max (tokens) of the --adaptive time run (default %(default)s)")  # fmt: skip
    p.add_argument("--phases", default="0.3/0.02,0/0.5,0.3/0.02,0/0.5",
                   help="CHAT_QPS/SUMM_QPS per phase, comma-separated (default: interactive, document batch, "
                   "x2)")  # fmt: skip
    p.add_argument(
        "--phase-seconds", type=float, default=60.0, help="seconds per phase (default %(default)s)"
    )
    p.add_argument(
        "--chat-scale", type=float, default=0.05, help="CPU scaling of ShareGPT lengths (default %(default)s)"
    )
    p.add_argument(
        "--summ-scale", type=float, default=0.25, help="CPU scaling of arXiv lengths (default %(default)s)"
    )
    p.add_argument(
        "--chat-tbt-slo", type=float, default=1.0, help="chat P99 TBT SLO, s (default %(default)s)"
    )
    p.add_argument("--chat-ttft-slo", type=float, default=20.0, help="chat TTFT SLO, s (default %(default)s)")
    p.add_argument(
        "--summ-tbt-slo", type=float, default=5.0, help="summarization P99 TBT SLO, s (default %(default)s)"
    )
    p.add_argument(
        "--summ-ttft-slo", type=float, default=60.0, help="summarization TTFT SLO, s (default %(default)s)"
    )
    p.add_argument("--interval", type=int, default=5,
                   help="controller.intervalSeconds: seconds between decisions (default %(default)s)")  # fmt: skip
    p.add_argument("--window", type=int, default=15,
                   help="controller.windowSeconds: the engines' metrics window, >= --interval and >= 5; also "
                   "the window of the client-side P99 TBT timeline (default %(default)s)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine.maxNumSeqs (default %(default)s)")
    p.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of the engine (default %(default)s)"
    )
    p.add_argument("--cost-model", metavar="JSON", default=None,
                   help="`stallfree profile` cost model for the controller (default: its built-in one)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=None,
                   help="client timeout per request, s (default: long enough that only requests that already "
                   "missed their SLOs are cut off)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="port of `stallfree up` (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for each deployment's /ready (default %(default)s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, forward in odd rounds and backward in even "
                   "ones, each round in OUT/round-K, and report the median of the rounds' ratios in "
                   "OUT/rounds.json and rounds.png: one run each cannot tell the controller from the box's "
                   "drift (default %(default)s)")  # fmt: skip
    p.add_argument("--report", action="store_true",
                   help="run nothing: score, summarize, plot and tabulate again the finished run in --out, "
                   "from its records and the command line saved in its results.json (other options are "
                   "ignored), e.g. after the plot failed or a figure was added")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.report:
        return report(Path(a.out))
    try:
        phases = parse_phases(a.phases)
        budgets = sorted({int(b) for b in a.budgets.split(",")})
        specs = cluster_specs(vars(a))
        cfg = LiveConfig(specs, tuple(budgets), a.initial, a.interval, a.window, a.max_num_seqs,
                         a.adaptive, a.time_target, a.time_cap)  # fmt: skip
        runs: list[tuple[str, int | None]] = [(f"static-{b}", b) for b in budgets] + [("adaptive", None)]
        docs = {name: deployment(cfg, b) for name, b in runs}
        for doc in docs.values():
            validate_deployment(doc)  # what `stallfree up` checks, before any engine starts
    except ValueError as e:
        p.error(str(e))
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    reqs, starts = build_workload(a.phase_seconds, phases, (a.chat_scale, a.summ_scale), a.seed)
    if not reqs:
        p.error("the workload has no requests: raise the rates or --phase-seconds")
    timeout = a.request_timeout or request_timeout(reqs, specs)
    out, names, budget_of = Path(a.out), [name for name, _ in runs], dict(runs)
    done = []
    for k, rout in enumerate(rounds.round_dirs(out, a.rounds)):
        order = rounds.run_order(names, k)
        if a.rounds > 1:
            print(f"round {k + 1} of {a.rounds}: {' -> '.join(order)}", file=sys.stderr, flush=True)
        done.append(
            run_round(rout, [(n, budget_of[n]) for n in order], docs, reqs, starts, specs, a, timeout)
        )
        finish(rout, done[-1], budgets, phases, specs)
    return rounds.finish(out, done, names) if a.rounds > 1 else 0


def run_round(
    out: Path,
    order: Sequence[tuple[str, int | None]],
    docs: dict,
    reqs: Sequence[Req],
    starts: list[float],
    specs: Sequence[ClusterSpec],
    a: argparse.Namespace,
    timeout: float,
) -> dict:
    """Every run of `order` one after the other, scored; results.json is written after each run."""
    (out / "specs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    results: dict = {"config": {**vars(a), "request_timeout_s": timeout}, "complete": False,
                     "num_requests": len(reqs), "phase_starts": starts, "order": [n for n, _ in order],
                     "static": {}, "adaptive": None}  # fmt: skip
    t_all = time.monotonic()
    for name, b in order:
        records, info = run_one(name, docs[name], reqs, a, out, timeout)
        sc = {**judge(records, reqs, specs, starts, a.phase_seconds, a.interval, a.window), **info}
        if b is None:
            sc["recovery_intervals"] = recovery_intervals(sc["timeline"], starts, specs, a.interval)
            sc["violation_episodes"] = violation_episodes(sc["timeline"], specs, a.interval)
            results["adaptive"] = sc
        else:
            del sc["timeline"]  # no decisions with the controller off; budgets_seen shows B held
            results["static"][b] = sc
        print(f"{name}: goodput {sc['goodput']:.3f} req/s, attainment {sc['attainment']:.1%}, "
              f"outcomes {sc['outcomes']}", file=sys.stderr)  # fmt: skip
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["complete"] = True
    results["wall_s"] = round(time.monotonic() - t_all, 1)
    return results


def finish(
    out: Path, results: dict, budgets: Sequence[int], phases: Sequence[tuple[float, float]], specs
) -> None:
    """The summary of a finished run, saved with it, its plot and its table (after a run and --report)."""
    starts, phase_s = results["phase_starts"], results["config"]["phase_seconds"]
    results["summary"] = summarize(results, budgets, len(starts), phase_s)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, budgets, starts, phases, specs, phase_s, out / "phase_live.png",
         xlabel="seconds since the replay started (live deployment)")  # fmt: skip
    print(table(results, budgets))


def cluster_specs(c: dict) -> tuple[ClusterSpec, ClusterSpec]:
    """chat (priority 10) and summarization (priority 0) with the SLOs of the command line `c`."""
    return (
        ClusterSpec("chat", Slo(c["chat_ttft_slo"], c["chat_tbt_slo"], c["chat_ttft_slo"]), priority=10),
        ClusterSpec(
            "summarization", Slo(c["summ_ttft_slo"], c["summ_tbt_slo"], c["summ_ttft_slo"]), priority=0
        ),
    )


def report(out: Path) -> int:
    """--report: score, summary, plot and table of a finished run again, from what it saved in `out`
    (results.json with the run's own command line, and the records), so a figure added since is there.
    A run of several rounds (OUT/round-K) is reported round by round, then their medians."""
    dirs = sorted(out.glob("round-*/results.json"), key=lambda f: int(f.parent.name.split("-")[1]))
    if dirs and not (out / "results.json").exists():
        done = [report_one(f.parent) for f in dirs]
        budgets = sorted(done[0]["static"])
        return rounds.finish(out, done, [*(f"static-{b}" for b in budgets), "adaptive"])
    report_one(out)
    return 0


def report_one(out: Path) -> dict:
    """One run (one round) scored again from its records: finish() writes it, and it is returned."""
    path = out / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m experiments.phase.live --report: cannot read {path}: {e}") from None
    if not results.get("complete") or not results.get("adaptive"):
        raise SystemExit(
            f"python -m experiments.phase.live --report: {path} holds an unfinished run: nothing to report"
        )
    results["static"] = {int(b): sc for b, sc in results["static"].items()}
    budgets = sorted(results["static"])
    c = results["config"]
    starts, phase_s = results["phase_starts"], c["phase_seconds"]
    phases, specs = parse_phases(c["phases"]), cluster_specs(c)
    reqs, _ = build_workload(phase_s, phases, (c["chat_scale"], c["summ_scale"]), c["seed"])
    if len(reqs) != results["num_requests"]:
        raise SystemExit(f"python -m experiments.phase.live --report: the saved command line gives {len(reqs)} requests, "
                         f"the run had {results['num_requests']}")  # fmt: skip
    for name, sc in [
        *((f"static-{b}", results["static"][b]) for b in budgets),
        ("adaptive", results["adaptive"]),
    ]:
        records = [RequestRecord.from_json(d) for d in json.loads((out / f"records-{name}.json").read_text())]
        sc.update(judge(records, reqs, specs, starts, phase_s, c["interval"], c["window"]))
    results["adaptive"]["recovery_intervals"] = recovery_intervals(
        results["adaptive"]["timeline"], starts, specs, c["interval"]
    )
    results["adaptive"]["violation_episodes"] = violation_episodes(
        results["adaptive"]["timeline"], specs, c["interval"]
    )
    finish(out, results, budgets, phases, specs)
    return results


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def cluster_cell(sc: dict, fmt) -> str:
    """One figure per traffic cluster (`name figure`, space-separated); '-' for runs scored before."""
    return " ".join(f"{n} {fmt(f)}" for n, f in sc.get("clusters", {}).items()) or "-"


def table(results: dict, budgets: Sequence[int]) -> str:
    rows = [("run", "goodput/s", "attain", "good/requests per phase", "ok rej err t/o", "P99 TBT per cluster",
             "TTFT P50/P99 per cluster", "load 1m", "steal", "startup")]  # fmt: skip
    for name, sc in [
        *((f"static {b}", results["static"][b]) for b in budgets),
        ("adaptive", results["adaptive"]),
    ]:
        o = sc["outcomes"]
        rows.append((name, f"{sc['goodput']:.3f}", f"{sc['attainment']:.1%}",
                     " ".join(f"{p['good']}/{p['requests']}" for p in sc["phases"]),
                     f"{o['ok']} {o['rejected']} {o['error']} {o['timeout']}",
                     cluster_cell(sc, lambda f: _s(f["tbt_p99_s"])),
                     cluster_cell(sc, lambda f: f"{_s(f['ttft_p50_s'])}/{_s(f['ttft_p99_s'])}"),
                     f"{sc['loadavg_before'][0]:.2f}->{sc['loadavg_after'][0]:.2f}",
                     f"{sc['host']['steal_share']:.1%}" if "steal_share" in sc.get("host", {}) else "-",
                     f"{sc['startup_s']:.0f}s"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    s = results["summary"]
    lines.append(
        f"best static {s['best_static_budget']}: {s['best_static_goodput']:.3f}/s; oracle {s['oracle_goodput']:.3f}/s "
        f"(budgets {s['oracle_budgets']}); adaptive/best static {s['adaptive_vs_best_static']:.2f}x, "
        f"adaptive/oracle {s['adaptive_vs_oracle']:.2f}x; recovery intervals after each phase change "
        f"{s['recovery_intervals']} (controller's view), {s['client_recovery_intervals']} (client's view)"
    )
    eps = s.get("interval_violation_episodes")
    if eps:  # absent from runs scored before episodes were counted
        lines.append("violations of P99 TBT (each interval's own): " + "; ".join(
            f"from {e['start']:.0f} s, {e['intervals']} intervals, worst {e['worst']:.2f}x" for e in eps))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
