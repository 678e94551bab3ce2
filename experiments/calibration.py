"""Does the engine's cost model become true on its own? Predicted against observed iteration time, live.

    python -m experiments.calibration [--qps 0.5] [--num-requests 120] [--seeds 0] [--cost-model FILE]
        [--out results/calibration]

For each seed a fresh `stallfree serve` in its default mode (time-budgeted iterations, told the protocol's
SLOs; no --cost-model unless given, so the engine starts from its built-in prior) writes an iteration log
while it serves --num-requests requests of the capacity protocol's workload (ShareGPT lengths x --scale,
<= --max-output-tokens out, Poisson at --qps, seeded). Every line of the log holds what the engine's cost
model predicted for that iteration before it ran (`predicted_s`) and what the step took (`step_s`).

Reported per seed: |predicted / observed - 1| at the median and P95 over sliding windows of --window
iterations, and N, the first iteration from which every later window meets median <= 10% and P95 <= 25%
(None when the run never settles there). Output: calibration.json and calibration.png (the ratio per
iteration and the windowed quantiles) in --out, and a table.

    python -m experiments.calibration --logs RUN/iterations-*.jsonl [--out DIR]

reads iteration logs that servers already wrote (`stallfree bench capacity --iteration-logs`, each server
fresh) instead of running one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from experiments.protocol import add_protocol_args, protocol_workload
from stallfree.bench.launcher import ServerProcess, ServerSpec
from stallfree.bench.metrics import slo_attainment
from stallfree.bench.serve_cmd import bench_once
from stallfree.bench.simulate import workload_of
from stallfree.slo import Slo

MEDIAN_BAR, P95_BAR = 0.10, 0.25


def read_log(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predicted, observed) seconds of every iteration in an iteration log that carries predictions, and
    whether each held a prefill chunk (the iterations whose size the scheduler chooses)."""
    pred, obs, prefill = [], [], []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        doc = json.loads(line)
        if doc.get("predicted_s") is not None and doc.get("step_s", 0) > 0:
            pred.append(doc["predicted_s"])
            obs.append(doc["step_s"])
            prefill.append(any(not dec for _, _, dec in doc.get("chunks", [])))
    return np.asarray(pred), np.asarray(obs), np.asarray(prefill, dtype=bool)


def windows(dev: np.ndarray, window: int) -> list[tuple[int, float, float]]:
    """(end index, median, P95) of |ratio - 1| over each window of `window` iterations, one per step."""
    out = []
    for end in range(window, len(dev) + 1):
        w = dev[end - window : end]
        out.append((end, float(np.median(w)), float(np.percentile(w, 95))))
    return out


def settled_at(wins: list[tuple[int, float, float]], window: int) -> int | None:
    """The first iteration from which every window (of those starting there or later) meets the bars."""
    ok = [m <= MEDIAN_BAR and p <= P95_BAR for _, m, p in wins]
    if not ok or not ok[-1]:
        return None
    i = len(ok) - 1
    while i > 0 and ok[i - 1]:
        i -= 1
    return wins[i][0] - window


def analyse(pred: np.ndarray, obs: np.ndarray, window: int, prefill: np.ndarray | None = None) -> dict:
    """The windows, N, and the quantiles after N (or over the second half when it never settles); with
    `prefill`, the same quantiles over the iterations that held a prefill chunk."""
    ratio = pred / obs
    dev = np.abs(ratio - 1.0)
    wins = windows(dev, window)
    n = settled_at(wins, window)
    after = dev[n:] if n is not None else dev[len(dev) // 2 :]
    return {
        "iterations": len(dev),
        "settled_after_iterations": n,
        "after": {
            "from": n if n is not None else len(dev) // 2,
            "median": float(np.median(after)) if len(after) else None,
            "p95": float(np.percentile(after, 95)) if len(after) else None,
            "median_ratio": float(np.median(ratio[n or len(dev) // 2 :])) if len(after) else None,
        },
        "first_window": {"median": wins[0][1], "p95": wins[0][2]} if wins else None,
        "after_prefill_iterations": None
        if prefill is None
        else _quantiles(dev[n or len(dev) // 2 :][prefill[n or len(dev) // 2 :]]),
        "ratio": [round(float(x), 4) for x in ratio],
        "windows": wins,
    }


def analyse_log(path: Path, window: int) -> dict:
    pred, obs, prefill = read_log(path)
    return analyse(pred, obs, window, prefill)


def _quantiles(dev: np.ndarray) -> dict | None:
    if not len(dev):
        return None
    return {"count": len(dev), "median": float(np.median(dev)), "p95": float(np.percentile(dev, 95))}


def plot(results: dict, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        ratio = r["ratio"]
        ax.plot(range(len(ratio)), ratio, ".", ms=2, color="#999", label="predicted / observed")
        ends = [w[0] for w in r["windows"]]
        ax.plot(ends, [1 + w[1] for w in r["windows"]], color="C0", label=f"1 + median |r-1| ({window} it.)")
        ax.plot(ends, [1 + w[2] for w in r["windows"]], color="C3", label="1 + P95 |r-1|")
        for bar in (1 + MEDIAN_BAR, 1 + P95_BAR):
            ax.axhline(bar, color="k", ls=":", lw=0.8)
        if r["settled_after_iterations"] is not None:
            ax.axvline(r["settled_after_iterations"], color="C2", ls="--", label="settled")
        ax.set_ylim(0, 3)
        ax.set_xlabel("iteration")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qps", type=float, default=0.5, help="Poisson arrival rate (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=120, help="requests per server (default %(default)s)")
    ap.add_argument("--seeds", default="0", help="request samples, one fresh server each")
    add_protocol_args(ap)
    ap.add_argument("--time-target", type=float, default=0.8)
    ap.add_argument("--cost-model", default=None, help="the engine's prior (default: none, the built-in)")
    ap.add_argument("--window", type=int, default=100, help="iterations per window (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/calibration")
    ap.add_argument("--logs", nargs="+", default=None, metavar="LOG",
                    help="analyse these iteration logs (one fresh server each) instead of running servers")  # fmt: skip
    a = ap.parse_args(argv)
    if a.logs:
        return report({p: analyse_log(Path(p), a.window) for p in a.logs}, a, Path(a.out))
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    args, trace, model, load_format = protocol_workload(a)
    slo = Slo(ttft_p99=a.slo_ttft, tbt_p99=a.slo_tbt)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for seed in seeds:
        log = out / f"iterations-s{seed}.jsonl"
        log.unlink(missing_ok=True)
        extra = ["--iteration-log", str(log)] + (["--cost-model", a.cost_model] if a.cost_model else [])
        spec = ServerSpec(token_budget=2048, time_target=a.time_target, slo=(a.slo_tbt, a.slo_ttft),
                          model=model, load_format=load_format, threads=a.threads, extra_args=extra)  # fmt: skip
        wl = workload_of(trace, args, a.qps, seed=seed)
        with ServerProcess(spec, out / f"server-s{seed}.log") as server:
            _, records = bench_once(server.url, wl, slo, desc=f"seed {seed}")
        r = analyse_log(log, a.window)
        r["attainment"] = slo_attainment(records, slo.ttft_p99, slo.tbt_p99)
        results[f"seed {seed}"] = r
    return report(results, a, out)


def report(results: dict[str, dict], a: argparse.Namespace, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"\npredicted / observed iteration time, windows of {a.window} iterations, from the built-in prior"
          if a.cost_model is None else f"\n... from the prior {a.cost_model}")  # fmt: skip
    for name, r in results.items():
        after, att = r["after"], r.get("attainment")
        print(f"{name}: {r['iterations']} iterations; settled (median <= {MEDIAN_BAR:.0%}, P95 <= {P95_BAR:.0%} in "
              f"every later window) after N = {r['settled_after_iterations']}; from there |r-1| median "
              f"{after['median']:.3f}, P95 {after['p95']:.3f}, median ratio {after['median_ratio']:.3f}; first "
              f"window median {r['first_window']['median']:.3f}, P95 {r['first_window']['p95']:.3f}"
              + ("" if att is None else f"; attainment {att:.1%}"))  # fmt: skip
        pf = r.get("after_prefill_iterations")
        if pf:
            print(f"  the {pf['count']} iterations with prefill among them: |r-1| median {pf['median']:.3f}, "
                  f"P95 {pf['p95']:.3f}")  # fmt: skip
    (out / "calibration.json").write_text(json.dumps({"args": vars(a), "results": results}))
    plot(results, a.window, out / "calibration.png")
    print(f"wrote {out / 'calibration.json'} and calibration.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
