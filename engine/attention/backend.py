"""The interface every attention backend implements (after vLLM's AttentionBackend + metadata builder).

A backend owns nothing but its view of the KV cache and whatever its kernels need between iterations
(workspaces, plans). Per iteration the runner hands it the one common `DeviceBatch`; the backend builds
its own metadata from it (`build_metadata`) and binds that into the function the model calls once per layer
(`bind`). It describes itself in class attributes that the registry reads before building one: the
devices and dtypes it runs, those in which `auto` may choose it, and whether this machine has its kernels.
It also says what the runner should do around it: which fused elementwise kernels the model runs with,
whether it can be replayed inside CUDA graphs, whether its kernels compile on first use (a warm-up batch
before the engine reports ready), and whether sampling stays on the device.

NOTE: the causal rule is bottom-right aligned: query i of a chunk that starts at absolute position s sees
keys at positions 0 .. s + i. That is what makes a chunked prefill compute the same thing as a one-shot one.
Metadata is always an explicit argument, never a global.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from stallfree.engine.attention.batch import DeviceBatch
from stallfree.engine.attention.kv_cache import KVCache
from stallfree.engine.model.cpu_stack import PagedRows
from stallfree.engine.model.llama import AttentionFn

FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


class AttentionBackend:
    """Attention over the paged KV cache for one model shard (heads of this rank)."""

    name: ClassVar[str]
    # What the registry reads before it builds one (registry.py loops over the classes; nothing asks for a
    # backend by name): the device types it runs on, the dtypes its kernels take, and the dtypes in which
    # `auto` may choose it on those devices (empty: only when asked for by name).
    devices: ClassVar[frozenset[str]] = frozenset()
    dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES
    auto_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # Whether decode iterations (and the layers between attentions) may be captured in CUDA graphs: the
    # backend then implements `decode_fn` and `splits`, and `bind(..., store=False)`.
    supports_graphs: ClassVar[bool] = False
    # Whether the kernels compile on first use, so the runner runs a warm-up batch before serving.
    compiles_kernels: ClassVar[bool] = False
    # Whether the runner samples on the device in one batch (GpuSampler) rather than row by row.
    samples_on_device: ClassVar[bool] = False

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on `device` in `dtype` (a short reason), or None when it can."""
        if device.type not in cls.devices:
            where = " or ".join(
                "a CUDA device" if d == "cuda" else f"the {d.upper()}" for d in sorted(cls.devices)
            )
            return f"the {cls.name} attention backend needs {where}"
        if dtype not in cls.dtypes:
            return f"the {cls.name} attention backend has no {str(dtype).removeprefix('torch.')} kernels"
        return None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this machine cannot build the kernels (a package or a compiler missing), or None. Only
        `auto` asks: a backend asked for by name fails at construction, with the full error."""
        return None

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @property
    def kernels(self) -> ModuleType | None:
        """The module of fused elementwise ops the model runs its layers with (add_rmsnorm, rope_,
        silu_and_mul, store_kv), or None for plain torch ops (the reference path)."""
        return None

    def build_metadata(self, batch: DeviceBatch, padded_decodes: int) -> Any:
        """This backend's description of the iteration, derived from the common batch only.

        padded_decodes: the decode count the graphs would pad to (kernels whose split counts must agree
        between graphs and eager runs size themselves by it); equal to the decode count without graphs."""
        raise NotImplementedError

    def bind(self, meta: Any, store: bool = True) -> AttentionFn:
        """The per-layer attention of this iteration. store=False when the caller already wrote the new
        K/V (the piecewise CUDA graphs do it inside the graph)."""
        raise NotImplementedError

    def paged_rows(self, meta: Any) -> PagedRows | None:
        """What a model that stores and attends by itself needs of this iteration (its caches and every row's
        block table and key count: a CPU-packed model's one-call layer stack, model/cpu_stack.py), where the
        backend offers that; None where it does not (the default)."""
        return None

    def splits(self, padded_batch: int) -> int:
        """Split-KV count of the decode kernel at this padded batch size (graph-capable backends)."""
        return 1

    def decode_fn(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, splits: int
    ) -> AttentionFn:
        """The attention of a decode-only batch over persistent buffers (what the CUDA graphs capture)."""
        raise NotImplementedError(f"the {self.name} attention backend does not run inside CUDA graphs")
