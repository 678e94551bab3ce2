"""How busy this host was while something was measured: load average, and the share of CPU time the
hypervisor gave to other guests (steal).

This box is a VM on a shared host. When the host is busy, our vCPUs wait: every engine step gets slower
for reasons no part of stallfree controls, and a latency measured then is not the machine's. Load average
does not show it (our own processes are all that run here); steal time does. Every benchmark records both
over its own span, so a disturbed run can be told apart from a slow configuration.

Steal does not show everything: in session 7 two runs 45 minutes apart, both under 0.3% steal, served the
same requests at budget 128 with chat's median gap 0.19 s in one and 0.15 s in the other. A low steal
share rules one cause out; only repeats side by side show how far a figure moves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# Above this steal share the host took a noticeable part of our CPUs: say so next to the figure.
DISTURBED_STEAL = 0.05


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative CPU time of all CPUs, in clock ticks, from /proc/stat's "cpu" line."""

    total: int
    idle: int  # idle + iowait
    steal: int

    @classmethod
    def parse(cls, text: str) -> CpuTimes:
        for line in text.splitlines():
            fields = line.split()
            if fields and fields[0] == "cpu":
                # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
                # already counted in user and nice, so the total is the first eight.
                ticks = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
                return cls(total=sum(ticks), idle=ticks[3] + ticks[4], steal=ticks[7])
        raise ValueError("no aggregate 'cpu' line in /proc/stat text")

    @classmethod
    def read(cls, path: Path = PROC_STAT) -> CpuTimes | None:
        """None where there is no /proc/stat (not Linux): then only the load average is recorded."""
        try:
            return cls.parse(path.read_text())
        except (OSError, ValueError):
            return None


def shares(before: CpuTimes, after: CpuTimes) -> dict[str, float] | None:
    """Fractions of the CPU time between two reads: stolen by the host, busy here (neither idle nor stolen)."""
    total = after.total - before.total
    if total <= 0:
        return None
    steal = after.steal - before.steal
    idle = after.idle - before.idle
    return {"steal_share": steal / total, "busy_share": max(0.0, total - idle - steal) / total}


class HostWatch:
    """Start it before a measurement, call summary() after: what the host was like in between."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._cpu = CpuTimes.read(path)
        self._load = os.getloadavg()[0]

    def summary(self) -> dict:
        out: dict = {"loadavg_1m": {"before": self._load, "after": os.getloadavg()[0]}}
        now = CpuTimes.read(self._path)
        got = shares(self._cpu, now) if self._cpu is not None and now is not None else None
        if got is not None:
            out.update(got)
            out["disturbed"] = got["steal_share"] > DISTURBED_STEAL
        return out


def describe(host: dict) -> str:
    """One line for logs and tables: 'steal 1.2%, busy 48%, load 1.0->1.1'."""
    load = host.get("loadavg_1m", {})
    parts = []
    if "steal_share" in host:
        parts.append(f"steal {host['steal_share']:.1%}, busy {host['busy_share']:.0%}")
    if load:
        parts.append(f"load {load['before']:.1f}->{load['after']:.1f}")
    text = ", ".join(parts)
    return f"{text} (host disturbed)" if host.get("disturbed") else text
