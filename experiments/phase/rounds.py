"""Rounds of the live phase-shift experiment: the same runs repeated on a noisy box, and their medians.

One live run of each configuration takes minutes, and a shared two-core machine changes speed by tens of
percent between minutes without any steal showing (docs/controller.md, session 7: the same static budget
made 0.275 and 0.431 good requests/s in two runs). So `python -m experiments.phase.live --rounds N` runs every
configuration N times, forward in odd rounds and backward in even ones (a slow drift in the box's speed
then weighs on every configuration alike over a pair of rounds), keeps each round a complete run of its
own (OUT/round-K/, which `--report` can score again), and reports each round's ratios, measured side by
side within it, and their medians across rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from statistics import median

import numpy as np

from stallfree.bench import report


def run_order(names: Sequence[str], k: int) -> list[str]:
    """The order of round k (0-based): forward in even rounds, backward in odd ones."""
    return list(names) if k % 2 == 0 else list(reversed(names))


def round_dirs(out: Path, rounds: int) -> list[Path]:
    """Where each round's run goes: OUT itself for a single round, else OUT/round-1 ... OUT/round-N."""
    return [out] if rounds == 1 else [out / f"round-{k + 1}" for k in range(rounds)]


def _within(intervals: Sequence[int | None] | None, n: int = 3) -> tuple[int, int]:
    """(phase changes recovered within n intervals, phase changes)."""
    got = list(intervals or [])
    return sum(i is not None and i <= n for i in got), len(got)


def aggregate(results: Sequence[dict], names: Sequence[str]) -> dict:
    """Each round's goodput per run and ratios, and their medians across rounds (ratios are taken within a
    round, best static and oracle included, then the median of those is reported)."""
    rows = []
    for k, res in enumerate(results):
        s = res["summary"]
        goodput = {f"static-{b}": sc["goodput"] for b, sc in res["static"].items()}
        goodput["adaptive"] = res["adaptive"]["goodput"]
        steal = [
            sc["host"]["steal_share"] for sc in [*res["static"].values(), res["adaptive"]] if sc.get("host")
        ]
        rows.append({
            "round": k + 1,
            "order": res.get("order"),
            "goodput": goodput,
            "best_static_budget": s["best_static_budget"],
            "adaptive_vs_best_static": s["adaptive_vs_best_static"],
            "adaptive_vs_oracle": s["adaptive_vs_oracle"],
            "ceiling_vs_best_static": s["ceiling_vs_best_static"],
            "interval_recovery_intervals": s.get("interval_recovery_intervals"),
            "recovery_intervals": s["recovery_intervals"],
            "max_steal_share": max(steal) if steal else None,
        })  # fmt: skip
    within = [_within(r["interval_recovery_intervals"]) for r in rows]
    return {
        "rounds": rows,
        "median": {
            "adaptive_vs_best_static": median(r["adaptive_vs_best_static"] for r in rows),
            "adaptive_vs_oracle": median(r["adaptive_vs_oracle"] for r in rows),
            "ceiling_vs_best_static": median(r["ceiling_vs_best_static"] for r in rows),
            "goodput": {n: median(r["goodput"][n] for r in rows) for n in names},
        },
        "recovered_within_3_own_p99": [sum(w for w, _ in within), sum(n for _, n in within)],
    }


def table(agg: dict, names: Sequence[str]) -> str:
    head = ("round", *names, "best static", "adaptive/best", "adaptive/oracle", "recovery (own P99)", "steal")
    rows = [
        (r["round"], *(f"{r['goodput'][n]:.3f}" for n in names), r["best_static_budget"],
         f"{r['adaptive_vs_best_static']:.2f}x", f"{r['adaptive_vs_oracle']:.2f}x",
         str(r["interval_recovery_intervals"]), report.fmt(r["max_steal_share"], ".1%"))
        for r in agg["rounds"]
    ]  # fmt: skip
    m = agg["median"]
    w, n = agg["recovered_within_3_own_p99"]
    rows.append(("median", *(f"{m['goodput'][x]:.3f}" for x in names), "",
                 f"{m['adaptive_vs_best_static']:.2f}x", f"{m['adaptive_vs_oracle']:.2f}x",
                 f"{w} of {n} within 3", ""))  # fmt: skip
    note = "goodput in good requests/s; ratios within each round, then their median across rounds"
    return f"{report.table(head, rows)}\n{note}"


def plot(agg: dict, names: Sequence[str], path: Path) -> None:
    """Goodput of every run in every round (dots, one shade per round) and the median (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(len(names))
    med = [agg["median"]["goodput"][n] for n in names]
    ax.bar(x, med, color=["#9ecae1"] * (len(names) - 1) + ["#fd8d3c"], label="median over rounds")
    for r in agg["rounds"]:
        ax.plot(x, [r["goodput"][n] for n in names], "o", alpha=0.8, label=f"round {r['round']}")
    ax.set_xticks(x, names)
    ax.set_ylabel("goodput (good requests/s)")
    ax.set_title("live phase-shift runs, every round")
    top = max(max(r["goodput"].values()) for r in agg["rounds"])
    ax.set_ylim(0, top * 1.3)  # room for the legend above the dots
    ax.legend(fontsize=8, loc="upper center", ncol=len(agg["rounds"]) + 1)
    ratios = [r["adaptive_vs_best_static"] for r in agg["rounds"]]
    bx.plot(np.zeros(len(ratios)), ratios, "o", color="#fd8d3c")
    bx.axhline(agg["median"]["adaptive_vs_best_static"], color="#fd8d3c", label="median")
    bx.axhline(1.0, color="grey", linestyle=":", label="= best static")
    bx.axhline(1.2, color="green", linestyle="--", label="target 1.2x")
    bx.set_xticks([])
    bx.set_ylabel("adaptive / best static in the same round")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(out: Path, results: Sequence[dict], names: Sequence[str]) -> int:
    """rounds.json, rounds.png and the table, from every round's results.json (after a run and --report)."""
    agg = aggregate(results, names)
    report.write_json(out, "rounds.json", agg)
    plot(agg, names, out / "rounds.png")
    print(table(agg, names))
    return 0
