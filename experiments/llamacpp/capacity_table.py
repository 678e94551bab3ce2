"""Capacity searches against llama-server, side by side: one table and one plot from their capacity.json files.

    python -m experiments.llamacpp.capacity_table RUN_DIR... [--slo-tbt 0.5] [--out FILE.json] [--plot FILE.png]

Each RUN_DIR is the --out of one `stallfree bench capacity` search (ours with --policies, or the peer's with
--peer-url). A folder named `LABEL-sSEED[-...]` is shown as LABEL with that request sample. Folders of the same label
and sample (a search, then a single run at a lower QPS) are merged, and a sample's capacity is its highest
passing QPS below its lowest failing one (0: it failed at every run, so its capacity is below the lowest).
Printed: every sample's capacity and runs (QPS -> attainment, median and P99 gap between tokens, median
TTFT), then per label the median capacity over its samples. The plot shows attainment against QPS, one
line per sample.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from stallfree.bench.report import pyplot


def load_search(folder: Path, slo_tbt: str) -> dict:
    """One search folder: its label, request sample, server and runs (sorted by QPS)."""
    data = json.loads((folder / "capacity.json").read_text())
    (server, result), *rest = data["results"].items()
    if rest:
        raise SystemExit(f"{folder}: one server per search expected, found {len(rest) + 1}")
    runs = []
    for qps, run in sorted(result["measured"]["runs"].items(), key=lambda kv: float(kv[0])):
        runs.append(
            {
                "qps": float(qps),
                "attainment": run["attainment"][slo_tbt],
                "tbt_p50_s": run["tbt_s"]["p50"],
                "tbt_p99_s": run["tbt_s"]["p99"],
                "ttft_p50_s": run["ttft_s"]["p50"],
                "busy_share": run["host"]["busy_share"],
            }
        )
    match = re.fullmatch(r"(.+?)-s(\d+)(?:-.*)?", folder.name)
    label, seed = (match.group(1), int(match.group(2))) if match else (folder.name, data["args"]["seed"])
    return {
        "folder": str(folder),
        "label": label,
        "seed": seed,
        "server": server,
        "runs": runs,
    }


def merge(searches: list[dict], attainment: float) -> list[dict]:
    """One entry per label and request sample: the runs of every folder of it together (a search and a later
    single run at a lower QPS, say), its capacity the highest passing QPS below the lowest failing one."""
    merged: dict[tuple[str, int], dict] = {}
    for s in searches:
        m = merged.setdefault(
            (s["label"], s["seed"]),
            {"label": s["label"], "seed": s["seed"], "server": s["server"], "folders": [], "runs": []},
        )
        m["folders"].append(s["folder"])
        m["runs"] = sorted(m["runs"] + s["runs"], key=lambda r: r["qps"])
    for m in merged.values():
        failed = [r["qps"] for r in m["runs"] if r["attainment"] < attainment]
        m["fails_at"] = min(failed) if failed else None
        passed = [r["qps"] for r in m["runs"] if r["attainment"] >= attainment]
        below = [q for q in passed if m["fails_at"] is None or q < m["fails_at"]]
        m["capacity_qps"] = max(below) if below else 0.0
    return list(merged.values())


def display(label: str) -> str:
    """The plot's name for a folder label: sf -> stallfree, npN[bB] -> llama-server -np N [-b B]."""
    match = re.fullmatch(r"np(\d+)(?:b(\d+))?", label)
    if match:
        return f"llama-server -np {match.group(1)}" + (f" -b {match.group(2)}" if match.group(2) else "")
    return "stallfree sarathi@256" if label == "sf" else label


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="folders holding capacity.json")
    ap.add_argument(
        "--slo-tbt", default="0.5", help="the TBT SLO key the searches used (default %(default)s)"
    )
    ap.add_argument("--attainment", type=float, default=0.9, help="share that passes a run (default 0.9)")
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="write attainment vs QPS as PNG")
    a = ap.parse_args(argv)
    searches = merge([load_search(folder, a.slo_tbt) for folder in a.runs], a.attainment)
    for s in searches:
        print(
            f"{s['label']:>10s} s{s['seed']}  capacity {s['capacity_qps']:.3g} QPS (fails at {s['fails_at']})"
        )
        for r in s["runs"]:
            print(
                f"{'':14s}{r['qps']:6.3f} QPS  attainment {r['attainment']:6.1%}  TBT P50 "
                f"{r['tbt_p50_s'] * 1000:6.1f} ms  P99 {r['tbt_p99_s']:5.2f} s  TTFT P50 {r['ttft_p50_s']:6.2f} s"
            )
    labels: dict[str, list[dict]] = {}
    for s in searches:
        labels.setdefault(s["label"], []).append(s)
    summary = {}
    print("\nper label, median over request samples:")
    for label, group in labels.items():
        caps = [s["capacity_qps"] for s in group]
        summary[label] = {"seeds": [s["seed"] for s in group], "capacity_qps": caps,
                          "median_capacity_qps": statistics.median(caps),
                          "fails_at": [s["fails_at"] for s in group]}  # fmt: skip
        print(f"{label:>10s}: capacities {caps} -> median {statistics.median(caps):.3g} QPS; "
              f"fails at {summary[label]['fails_at']}")  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps({"attainment": a.attainment, "searches": searches, "labels": summary}, indent=1)
        )
    if a.plot:
        plt = pyplot()
        import matplotlib.ticker  # noqa: PLC0415 - only for the plot, after pyplot() chose its backend

        fig, ax = plt.subplots(figsize=(7, 4.2))
        colours = {label: f"C{i}" for i, label in enumerate(labels)}
        for s in searches:
            ax.plot([r["qps"] for r in s["runs"]], [r["attainment"] for r in s["runs"]], "o-",
                    color=colours[s["label"]], alpha=0.8,
                    label=display(s["label"]) if s is labels[s["label"]][0] else None)  # fmt: skip
        ax.axhline(a.attainment, color="grey", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlabel("QPS (Poisson)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
        ax.set_title("attainment vs load, one line per request sample", fontsize=10)
        fig.tight_layout()
        a.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
