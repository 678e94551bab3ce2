"""The simulator-accuracy protocol of docs/benchmarks.md §6 over one measurement folder.

    python -m experiments.sim_accuracy_protocol OUT        (`scripts/sim-accuracy --evaluate OUT` runs it)

OUT holds what `scripts/sim-accuracy --measure` wrote: profile/ (a grid profile), calib-sharegpt/ (one run
per server on the chat trace) and capacity-arxiv/ (a capacity search per server on the summarization trace),
both with iteration logs. Every measured summarization run is simulated again (the real scheduler on a
simulated clock, `experiments.sim_accuracy`) with each of these cost models:

- grid: the grid profile, the forward pass alone;
- served, chat trace: fitted to the calibration runs' iterations only;
- leave one out, same trace (A): for each server, fitted to the OTHER servers' summarization iterations, and
  scored on that server alone;
- leave one out, with calibration (B): (A) plus every calibration run's iterations;
- in-sample: every server's summarization iterations (an upper bound, not a prediction).

Output: OUT/fits/*/cost_model.json, OUT/summary.json, OUT/accuracy.png and a table in the terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.sim_accuracy import compare
from stallfree.bench import servedfit
from stallfree.bench.launcher import iteration_log_path as log_path
from stallfree.bench.report import pyplot, table, write_json
from stallfree.costmodel.fitted import FittedCostModel

HOLDOUT = 0.25  # as `stallfree profile --from-log`: the saved model never saw these blocks
TARGET_ERROR = 0.2


def fit_logs(paths: list[Path], out: Path) -> FittedCostModel:
    model, _ = servedfit.fit_logs(paths, "period", HOLDOUT, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / "cost_model.json")
    return model


def score(runs: list[dict], capacity: list[dict]) -> dict:
    errs = [r["tbt_s.p99"]["error"] for r in runs if r["tbt_s.p99"]["error"] is not None]
    return {
        "p99_tbt": {
            "runs": len(errs),
            "within_20pct": int(sum(abs(e) <= TARGET_ERROR for e in errs)),
            "median_abs_error": float(np.median(np.abs(errs))) if errs else None,
            "worst_error": max(errs, key=abs) if errs else None,
        },
        "capacity": {
            c["server"]: {
                "measured_bracket": c["measured_bracket"],
                "predicted": c["predicted"],
                "error_vs_midpoint": c["error_vs_midpoint"],
                "inside_bracket": c["inside_bracket"],
            }
            for c in capacity
        },
    }


def evaluate(folder: Path, grids: list[Path] | None = None) -> dict:
    capacity = json.loads((folder / "capacity-arxiv" / "capacity.json").read_text())
    servers = [n for n, r in capacity["results"].items() if n != "peer" and "server" in r]
    calib = sorted((folder / "calib-sharegpt").glob("iterations-*.jsonl"))
    arxiv = {s: log_path(folder / "capacity-arxiv", s) for s in servers}
    fits = folder / "fits"

    def whole(name: str, label: str, cost: FittedCostModel) -> dict:
        print(f"{label}: simulating every run of {', '.join(servers)}", flush=True)
        res = compare(capacity, cost)
        return {"name": name, "label": label, "runs": res["runs"], "capacity": res["capacity"]}

    def leave_one_out(name: str, label: str, extra: list[Path]) -> dict:
        runs: list[dict] = []
        caps: list[dict] = []
        for held in servers:
            logs = [arxiv[s] for s in servers if s != held] + extra
            cost = fit_logs(logs, fits / f"{name}-without-{held.replace('@', '-')}")
            print(f"{label}: fitted without {held} ({cost.meta['num_iterations']} iterations)", flush=True)
            res = compare(capacity, cost, servers=[held])
            runs += res["runs"]
            caps += res["capacity"]
        return {"name": name, "label": label, "runs": runs, "capacity": caps}

    grids = grids or [folder / "profile" / "cost_model.json"]
    rows = [
        whole(
            "grid" if k == 0 else f"grid-{g.parent.name}",
            f"grid profile ({g.parent.name})",
            FittedCostModel.load(g),
        )
        for k, g in enumerate(grids)
    ]
    rows += [
        whole("served-chat", "served, chat trace", fit_logs(calib, fits / "served-chat")),
        leave_one_out("loo-same-trace", "leave one out, same trace (A)", []),
        leave_one_out("loo-with-calibration", "leave one out, with calibration (B)", calib),
        whole("in-sample", "in-sample (all arxiv)", fit_logs(list(arxiv.values()), fits / "in-sample")),
    ]
    for r in rows:
        r["score"] = score(r["runs"], r["capacity"])
    slo = (folder / "slo.txt").read_text().strip() if (folder / "slo.txt").exists() else None
    return {
        "folder": str(folder),
        "servers": servers,
        "slo": slo,
        "target_error": TARGET_ERROR,
        "models": rows,
    }


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.0%}"


def print_summary(res: dict) -> None:
    servers = res["servers"]
    out = []
    for m in res["models"]:
        p = m["score"]["p99_tbt"]
        caps = m["score"]["capacity"]
        out.append(
            [
                m["label"],
                f"{p['within_20pct']} of {p['runs']}",
                "-" if p["median_abs_error"] is None else f"{p['median_abs_error']:.0%}",
                _pct(p["worst_error"]),
            ]
            + [
                f"{_pct(caps[s]['error_vs_midpoint'])}{' (in)' if caps[s]['inside_bracket'] else ''}"
                if s in caps
                else "-"
                for s in servers
            ]
        )
    heads = ["cost model", "P99 TBT within 20%", "median |err|", "worst"] + [f"capacity {s}" for s in servers]
    print(table(heads, out, title=f"\nsimulator accuracy ({res['slo'] or 'strict SLO'})"))


def plot(res: dict, out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    top = 0.0
    for m in res["models"]:
        pts = [(r["tbt_s.p99"]["measured"], r["tbt_s.p99"]["predicted"]) for r in m["runs"]
               if r["tbt_s.p99"]["error"] is not None]  # fmt: skip
        if pts:
            x, y = zip(*pts, strict=True)
            a1.scatter(x, y, s=18, label=m["label"])
            top = max(top, *x, *y)
    line = np.array([0, top * 1.05])
    a1.plot(line, line, color="black", lw=0.8)
    a1.fill_between(line, line * (1 - TARGET_ERROR), line * (1 + TARGET_ERROR), color="grey", alpha=0.15,
                    label="±20%")  # fmt: skip
    a1.set_xlabel("measured P99 TBT, s")
    a1.set_ylabel("predicted P99 TBT, s")
    a1.set_title("Every measured run, re-simulated")
    a1.legend(fontsize=7)
    servers, width = res["servers"], 0.8 / max(1, len(res["models"]))
    for k, m in enumerate(res["models"]):
        errs = [m["score"]["capacity"].get(s, {}).get("error_vs_midpoint") or 0.0 for s in servers]
        a2.bar(np.arange(len(servers)) + k * width, [e * 100 for e in errs], width, label=m["label"])
    a2.axhspan(-TARGET_ERROR * 100, TARGET_ERROR * 100, color="grey", alpha=0.15)
    a2.axhline(0, color="black", lw=0.8)
    a2.set_xticks(np.arange(len(servers)) + width * (len(res["models"]) - 1) / 2, servers)
    a2.set_ylabel("capacity error vs measured bracket midpoint, %")
    a2.set_title(f"Capacity at {res['slo'] or 'the strict SLO'}")
    fig.tight_layout()
    path = out / "accuracy.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.sim_accuracy_protocol",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("folder", help="what `scripts/sim-accuracy --measure OUT` wrote")
    ap.add_argument("--grid", nargs="+", type=Path, help="grid-profile cost models to compare (default: "
                    "FOLDER/profile/cost_model.json, the one the SLO and budget came from)")  # fmt: skip
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    missing = [p for p in ("profile/cost_model.json", "capacity-arxiv/capacity.json", "calib-sharegpt")
               if not (folder / p).exists()]  # fmt: skip
    if missing:
        print(f"accuracy_protocol: {folder} lacks {', '.join(missing)}: run `scripts/sim-accuracy --measure "
              f"{folder}` first", file=sys.stderr)  # fmt: skip
        return 2
    try:
        res = evaluate(folder, args.grid)
    except ValueError as e:
        print(f"accuracy_protocol: {e}", file=sys.stderr)
        return 2
    print_summary(res)
    path = write_json(folder, "summary.json", res)
    print(f"\nsaved {path}, {plot(res, folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
