"""The CPU kernels' build cache is shared by every checkout of the same code: loading them from a second copy of
the module (another worktree, another editable install) reuses the library instead of rebuilding it. Before
the build compiled a copy of the source kept in its own folder, the ninja file recorded the checkout's path and
each checkout rebuilt the other's library (50-90 s per load on a busy box, past servers' readiness limits)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.engine.kernels import cpu_fused

LOAD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cpu_fused_copy", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.load()
"""


def _load_from(module: Path, cache: Path) -> None:
    env = {**os.environ, "STALLFREE_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOAD, str(module)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_a_second_checkout_reuses_the_built_library(tmp_path: Path) -> None:
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernels cannot build here")
    here = Path(cpu_fused.__file__)
    copies = []
    for name in ("checkout-a", "checkout-b"):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(here, folder / here.name)
        shutil.copy(cpu_fused.SOURCE, folder / cpu_fused.SOURCE.name)
        copies.append(folder / here.name)
    cache = tmp_path / "cache"
    _load_from(copies[0], cache)  # builds
    (library,) = (cache / "cpu-kernels").glob("*/stallfree_cpu_*.so")
    built = library.stat().st_mtime_ns
    _load_from(copies[1], cache)  # same code elsewhere: must not rebuild
    _load_from(copies[0], cache)
    assert library.stat().st_mtime_ns == built
    assert len(list((cache / "cpu-kernels").iterdir())) == 1
