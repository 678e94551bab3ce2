"""House style as tests: ruff lint and format over the repo and mypy over the typed core (STYLE.md, habit 7).

Both tools run from the venv running pytest, from the repo root, so pyproject.toml's settings apply.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
# The paths STYLE.md keeps under mypy: scheduler, block manager, server and operator.
MYPY_PATHS = ["engine/scheduler.py", "engine/block_manager.py", "engine/server", "operator"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_ruff_check_passes() -> None:
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_format_is_clean() -> None:
    proc = _run("ruff", "format", "--check", ".")
    assert proc.returncode == 0, (
        f"ruff format would change files (run `ruff format .`):\n{proc.stdout}{proc.stderr}"
    )


def test_mypy_passes_on_typed_paths() -> None:
    proc = _run("mypy", *MYPY_PATHS)
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout}{proc.stderr}"
