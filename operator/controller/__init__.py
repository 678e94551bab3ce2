"""The budget controller: reads live P99 TBT/TTFT and queue metrics, retunes token budgets, chunk caps,
admission limits and replicas per traffic cluster.

- `types`, `decide`, `cost_model`: the pure decision core (no I/O).
- `promql`, `prometheus`, `direct`: metric sources (Prometheus, or engines' admin stats in local mode).
- `loop`: one control step (read -> decide -> apply -> status), holding settings when data is missing.
- `kopf_timer`: the operator side (the only module here that imports kopf).
"""

from stallfree.operator.controller.decide import decide
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
]
