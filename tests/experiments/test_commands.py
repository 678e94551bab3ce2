"""Every experiment stays runnable: `python -m experiments.NAME --help` answers from the repository root, in a
fresh process (imports and argument parsing; the runs themselves are tested where they are cheap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def runnable() -> list[str]:
    """Modules under experiments/ that run as `python -m`."""
    return sorted(
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "experiments").rglob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    )


def test_the_experiments_are_found():
    expected = {"experiments.phase.sim", "experiments.engine_bench", "experiments.capacity_study"}
    assert expected <= set(runnable())


@pytest.mark.parametrize("module", runnable())
def test_every_experiment_has_help(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lower().startswith("usage: "), proc.stdout
