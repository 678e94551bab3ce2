"""Experiment tests reuse the bench tests' factories (tests/bench/bench_factories.py) as plain modules."""

from __future__ import annotations

import sys
from pathlib import Path

for _p in (Path(__file__).parent, Path(__file__).parents[1] / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
