"""Attention over the paged KV cache: the common batch, the backend interface, the backends and their registry.

Per iteration the runner lays the scheduler's chunks out once as a `HostBatch` (batch.py: the only slot
arithmetic), copies it to the device as a `DeviceBatch`, and hands that to the chosen `AttentionBackend`
(backend.py), which builds its own metadata from it and binds the function the model calls once per layer
with the new tokens' q/k/v. That function writes k/v into the cache pages and returns attention over each
request's whole history plus the causal part of its current chunk.

Backends: torch (reference) in torch_backend.py, cpu (C++ kernels) in cpu_backend.py, triton (CUDA default,
graphs) in triton_backend.py, flashinfer in flashinfer_backend.py; each describes the devices and dtypes it
runs, and registry.py chooses one (`auto` included).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.engine.attention.backend import AttentionBackend
    from stallfree.engine.attention.batch import DeviceBatch, HostBatch, Stager, host_batch
    from stallfree.engine.attention.kv_cache import KVCache
    from stallfree.engine.attention.registry import (
        BACKENDS,
        FALLBACK,
        backend_class,
        make_backend,
        resolve_attention_backend,
    )

# Lazy, so that the registry's names (stallfree.engine.config reads them) come without torch.
_EXPORTS = {
    "AttentionBackend": "backend",
    "DeviceBatch": "batch",
    "HostBatch": "batch",
    "Stager": "batch",
    "host_batch": "batch",
    "KVCache": "kv_cache",
    "BACKENDS": "registry",
    "FALLBACK": "registry",
    "backend_class": "registry",
    "make_backend": "registry",
    "resolve_attention_backend": "registry",
}

__all__ = [
    "BACKENDS",
    "FALLBACK",
    "AttentionBackend",
    "DeviceBatch",
    "HostBatch",
    "KVCache",
    "Stager",
    "backend_class",
    "host_batch",
    "make_backend",
    "resolve_attention_backend",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
