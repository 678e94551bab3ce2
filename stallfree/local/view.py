"""The live terminal view of local mode (rich): per cluster SLOs, observed P99s, settings, decisions."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from stallfree.operator.controller.loop import ControlLoop
from stallfree.operator.controller.types import HOLD


def _s(v: float | None) -> str:
    return "–" if v is None else (f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s")


def _vs(observed: float | None, slo: float) -> Text:
    if observed is None:
        return Text(f"– / {_s(slo)}", style="dim")
    return Text(f"{_s(observed)} / {_s(slo)}", style="green" if observed <= slo else "bold red")


def render(loop: ControlLoop, endpoint: str, replicas: list[str], title: str) -> Panel:
    s = loop.settings
    snap = loop.last.snapshot if loop.last else None
    t = Table(expand=True, box=None, header_style="bold")
    for col in ("cluster", "prio", "P99 TBT / SLO", "P99 TTFT / SLO", "P50 delay / SLO", "waiting", "running",
                "req/s", "chunk cap", "max waiting"):  # fmt: skip
        t.add_column(col, justify="left" if col == "cluster" else "right")
    for spec in loop.specs:
        c = snap.cluster(spec.name) if snap else None
        k = s.knobs(spec.name)
        t.add_row(
            spec.name,
            str(spec.priority),
            _vs(c.tbt_p99 if c else None, spec.slo.tbt_p99),
            _vs(c.ttft_p99 if c else None, spec.slo.ttft_p99),
            _vs(c.scheduling_delay_p50 if c else None, spec.slo.scheduling_delay_p50),
            f"{c.waiting:.0f}" if c else "–",
            f"{c.running:.0f}" if c else "–",
            f"{c.arrival_rate:.2f}" if c else "–",
            str(k.chunk_cap if k.chunk_cap is not None else "–"),
            str(k.max_waiting if k.max_waiting is not None else "–"),
        )
    cfg = loop.config
    if s.time_target is None:
        budget = (("token budget ", "bold"), (str(s.token_budget), "bold magenta"),
                  f" in [{cfg.budget_min}, {cfg.budget_max}] step {cfg.align}")  # fmt: skip
    else:
        err = snap.cost_model_error if snap else None
        budget = (("time target ", "bold"), (f"{s.time_target:.2f}", "bold magenta"),
                  f" of the P99 TBT SLO (spec {cfg.time_target:.2f}), cap {s.token_budget} tokens, "
                  f"cost-model error {'–' if err is None else f'{err:.2f}'} (P95)")  # fmt: skip
    head = Text.assemble(
        ("OpenAI endpoint ", "bold"),
        (endpoint, "cyan"),
        f"   replicas {len(replicas)}/{s.replicas}   ",
        *budget,
    )
    if loop.holding:
        head.append(f"\nHOLDING last good settings: {loop.holding}", style="bold yellow")
    changes = [h for h in loop.history if h.action != HOLD][-6:]
    log = Table(box=None, show_header=False, expand=True)
    log.add_column("when", style="dim", width=10)
    log.add_column("action", width=10)
    log.add_column("why")
    import time as _time

    for h in changes:
        log.add_row(_time.strftime("%H:%M:%S", _time.localtime(h.time)), h.action, h.reason)
    if loop.last:
        log.add_row("now", loop.last.action, loop.last.reason, style="italic")
    return Panel(Group(head, t, Text("decisions", style="bold"), log), title=title, border_style="blue")
