"""Output helpers shared by the bench commands: terminal tables, JSON files, matplotlib (Agg)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def latency_cells(summary: dict) -> list[str]:
    """The latency columns every summary table shows: TTFT P50/P99, TBT P50/P99, scheduling delay P50, goodput."""
    return [
        ms(summary["ttft_s"]["p50"]),
        ms(summary["ttft_s"]["p99"]),
        ms(summary["tbt_s"]["p50"]),
        ms(summary["tbt_s"]["p99"]),
        ms(summary["scheduling_delay_s"]["p50"]),
        f"{summary['goodput_rps']:.3g}",
    ]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain fixed-width table (readable in logs and in markdown code blocks)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(out: Path, name: str, obj: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(obj, indent=2, default=_default))
    return path


def _default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"cannot serialise {type(o).__name__}")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def measured_vs_predicted(
    ax, points: Sequence[dict], xlabel: str, title: str, fit_marker: str = "o", **style
) -> None:
    """Scatter of a cost-model fit's points ({"time_s", "predicted_s", "held_out"}), fitted and held out
    marked apart, in ms, against the diagonal."""
    for held, mark, lab in ((False, fit_marker, "fit"), (True, "x", "held out")):
        pts = [p for p in points if p["held_out"] == held]
        ax.scatter([p["time_s"] * 1e3 for p in pts], [p["predicted_s"] * 1e3 for p in pts], marker=mark,
                   label=lab, **style)  # fmt: skip
    hi = max(p["time_s"] for p in points) * 1e3 * 1.05
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted ms")
    ax.set_title(title)
    ax.legend()
