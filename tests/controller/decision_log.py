"""Every decision `python -m experiments.phase.sim` takes, interval by interval, as JSON lines: the check that a change
meant to keep the decision core's behaviour (a refactor) keeps it.

    python tests/controller/decision_log.py LOG.jsonl -- --cost-model docs/figures/engine/cost_model_grouped_decode.json \
        --out DIR --seeds 0,1,2,3,4

Runs the phase-sim experiment as it is (experiments/phase/sim.py, imported from the repository root) with
`decide` wrapped: each line holds the seed, the interval's time, the action and reason,
the per-cluster actions and reasons, and the settings and controller state decided. Run it before and
after the change and `diff` the two logs: empty means the same decisions.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASE_SIM = "experiments.phase.sim"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    log_path, sim_args = argv[0], argv[2:]
    if str(REPO) not in sys.path:  # run as a script: the experiments folder sits at the repository root
        sys.path.insert(0, str(REPO))
    pe = importlib.import_module(PHASE_SIM)
    decide, one_seed = pe.decide, pe.one_seed
    seed = [None]
    lines: list[str] = []

    def logged_seed(a, s, *rest, **kw):
        seed[0] = s
        return one_seed(a, s, *rest, **kw)

    def logged_decide(snap, *args, **kw):
        d = decide(snap, *args, **kw)
        row = {"seed": seed[0], "t": snap.time, **dataclasses.asdict(d)}
        lines.append(json.dumps(row, sort_keys=True))
        return d

    pe.decide, pe.one_seed = logged_decide, logged_seed
    try:
        rc = pe.main(sim_args)
    finally:
        pe.decide, pe.one_seed = decide, one_seed
    with open(log_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} decisions -> {log_path}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
