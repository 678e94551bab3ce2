"""The budget controller: reads live P99 TBT/TTFT and queue metrics, retunes the time target (or in tokens
mode the token budget), chunk caps, admission limits and replicas per traffic cluster.

- `types`, `decide`: the pure decision core (no I/O); it plans with stallfree.costmodel, the iteration cost
  model it shares with the profiler and the simulator. `decide_time`: its rules for time mode, where the
  engines budget iterations in seconds and the controller tunes their time target.
- `promql`, `prometheus`, `direct`: metric sources (Prometheus, or engines' admin stats in local mode).
- `loop`: one control step (read -> decide -> apply -> status), holding settings when data is missing.
- `kopf_timer`: the operator side (the only module here that imports kopf).
"""

from stallfree.operator.controller.decide import decide
from stallfree.operator.controller.decide_time import decide_time
from stallfree.operator.controller.types import (
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Decision,
    Knobs,
    Settings,
    Slo,
    Snapshot,
    State,
)

__all__ = [
    "ClusterSnapshot",
    "ClusterSpec",
    "ControllerConfig",
    "Decision",
    "Knobs",
    "Settings",
    "Slo",
    "Snapshot",
    "State",
    "decide",
    "decide_time",
]
