"""The one place where an attention backend is chosen: the backends' names, and `auto`.

Each backend class describes itself (backend.py: the devices and dtypes it runs, the dtypes in which `auto`
may choose it, whether this machine has its kernels); the registry only lists the classes, in the order
`auto` tries them, and loops over them. Everything else asks the backend object what it does (its kernels,
graph support, sampling) instead of branching on its name.

NOTE: importing this module imports no torch (the engine's config takes the names from here, and
`stallfree serve --help` stays instant); a class is imported when it is first asked about.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from stallfree.engine.attention.backend import AttentionBackend
    from stallfree.engine.attention.kv_cache import KVCache

logger = logging.getLogger(__name__)

# name -> "module:Class", in the order `auto` tries them: the first that runs on the device, that `auto` may
# choose in the dtype (its auto_dtypes) and whose kernels this machine has.
BACKENDS: dict[str, str] = {
    "cpu": "stallfree.engine.attention.cpu_backend:CpuBackend",
    "triton": "stallfree.engine.attention.triton_backend:TritonBackend",
    "torch": "stallfree.engine.attention.torch_backend:TorchBackend",
    "flashinfer": "stallfree.engine.attention.flashinfer_backend:FlashInferBackend",
}
# What `auto` falls back to when the backend it chose cannot build its kernels (the engine says so, once).
FALLBACK = "torch"


def check_name(name: str) -> None:
    """ValueError unless `name` is auto or a registered backend."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")


def backend_class(name: str) -> type[AttentionBackend]:
    check_name(name)
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `name` stands for on this device and dtype; ValueError for impossible combinations.

    auto: the first backend in BACKENDS' order that runs on the device, that `auto` may choose in this dtype
    and whose kernels this machine has (one warning for each one it passes over for want of them). Today
    that is: on the CPU the C++ kernels (cpu), or torch where they cannot be built (no compiler); on CUDA in
    bf16/fp16 the Triton kernels, or torch without triton; on CUDA in fp32 torch (exact; flashinfer has no
    fp32 kernels and is chosen by name only).
    """
    check_name(name)
    if name == "auto":
        return _auto(device, dtype)
    why = backend_class(name).unsupported(device, dtype)
    if why is not None:
        raise ValueError(f"{why}: {_alternatives(device, dtype)}")
    return name


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    for name in BACKENDS:
        cls = backend_class(name)
        if device.type not in cls.devices or dtype not in cls.auto_dtypes:
            continue
        why = cls.unavailable()
        if why is None:
            return name
        logger.warning("the %s attention backend is not available (%s); trying the next", name, why)
    raise ValueError(f"no attention backend runs on {device.type} in {dtype}")


def _alternatives(device: torch.device, dtype: torch.dtype) -> str:
    """What the user could ask for instead, on this device and dtype."""
    fits = [n for n in BACKENDS if backend_class(n).unsupported(device, dtype) is None]
    dt = str(dtype).removeprefix("torch.")
    if not fits:
        return f"no attention backend runs on {device.type} in {dt}"
    return f"on {device.type} in {dt} use attention_backend auto or {', '.join(fits)}"


def make_backend(
    name: str, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """The backend `name` (already resolved: not auto) over `cache`, for this rank's heads."""
    return backend_class(name)(cache, num_heads, num_kv_heads, head_dim)
