"""Shared test set-up: factories live in plain modules next to the tests (tests/factories.py,
tests/costmodel/costmodel_factories.py, ...)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).parent
for p in (_TESTS, _TESTS / "engine", _TESTS / "costmodel"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# experiments/ (the figure-making runs, not in the installed package) is imported from the repository root.
# Appended, not prepended: the root also holds operator/, which must never shadow the standard library's.
if str(_TESTS.parent) not in sys.path:
    sys.path.append(str(_TESTS.parent))

# The box has 2 shared cores and other processes (servers, Prometheus, the API server) run beside the
# tests: with more than one OpenMP thread, a descheduled thread stalls every barrier and a decode step can
# take 10x longer. One thread per process is slower in the best case and far steadier.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without a GPU the Triton kernels (stallfree.engine.kernels) are checked through Triton's interpreter on CPU
# tensors. Triton reads this when a kernel is defined, so it must be set before anything imports them.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M-Instruct, loaded once per session in float32 (CPU)."""
    import torch

    from stallfree.engine.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(None, dtype=torch.float32)
