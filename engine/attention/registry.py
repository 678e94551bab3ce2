"""The one place where an attention backend is chosen: its name, the `auto` rules, and the checks that a
named backend can run on this device and dtype.

Everything else asks the backend object what it does (its kernels, graph support, sampling) instead of
branching on its name.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.kv_cache import KVCache

logger = logging.getLogger(__name__)

# name -> (module, class); imported on first use, so a machine without triton or flashinfer never loads them
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("stallfree.engine.attention.torch_backend", "TorchBackend"),
    "cpu": ("stallfree.engine.attention.torch_backend", "CpuBackend"),
    "triton": ("stallfree.engine.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("stallfree.engine.attention.flashinfer_backend", "FlashInferBackend"),
}
# What `auto` falls back to when the backend it chose cannot build its kernels (the engine says so, once).
FALLBACK = "torch"


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `name` stands for on this device and dtype; ValueError for impossible combinations.

    auto: on CUDA in bf16/fp16 the Triton kernels (they need no nvcc and compile in seconds); in fp32 the
    torch backend (exact; FlashInfer has no fp32 kernels); on the CPU the C++ kernels (`cpu`), or the
    torch backend where they cannot be built (no compiler), with one warning.
    """
    if name == "auto":
        return _auto(device, dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        return name  # Triton's interpreter runs the kernels on CPU tensors: slow, for tests of the CUDA path
    if name in ("triton", "flashinfer") and device.type != "cuda":
        raise ValueError(f"the {name} attention backend needs a CUDA device; use attention_backend='torch'")
    if name == "cpu" and device.type != "cpu":
        raise ValueError("the cpu attention backend runs on the CPU only; use auto, triton or torch on CUDA")
    if name == "flashinfer" and dtype == torch.float32:
        raise ValueError(
            "FlashInfer has no float32 kernels: use dtype bfloat16/float16 or attention_backend='torch'"
        )
    return name


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cpu":
        from stallfree.engine.kernels.cpu_fused import available  # noqa: PLC0415

        return "cpu" if available() else "torch"  # available() says why not, once
    if device.type != "cuda" or dtype == torch.float32:
        return "torch"
    from stallfree.engine.kernels.fused import triton_available  # noqa: PLC0415

    if triton_available():
        return "triton"
    logger.warning("triton is not installed: the torch attention backend runs on CUDA (slower)")
    return "torch"


def make_backend(
    name: str, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    """The backend `name` (already resolved: not auto) over `cache`, for this rank's heads."""
    return backend_class(name)(cache, num_heads, num_kv_heads, head_dim)
