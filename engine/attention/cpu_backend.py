"""The cpu backend: the C++ kernels of stallfree.engine.kernels.cpu_fused for the KV store, every row's
attention from the pages, and the layers' elementwise work.

Every row, decodes and prefill-chunk tokens alike, goes through one paged kernel, each row reading its
request's pages in place over the keys its position sees. NOTE: same request, same answer: a row at
position p is then attended by the same code over the same p + 1 keys whether it is a decode, a token of a
chunk (any split) or follows a prefix-cache hit (SDPA's blocked softmax over a chunk, which the torch
backend uses, rounds differently from a decode's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from stallfree.engine.attention.backend import FLOAT_DTYPES, AttentionBackend
from stallfree.engine.attention.batch import DeviceBatch
from stallfree.engine.attention.kv_cache import KVCache
from stallfree.engine.model.cpu_stack import PagedRows
from stallfree.engine.model.llama import AttentionFn


@dataclass(frozen=True, slots=True)
class CpuMetadata:
    """Every row (decodes first, then the chunks' tokens) by its request's block table and key count."""

    batch: DeviceBatch
    tables: torch.Tensor  # (T, max pages) int32  each row's request's blocks, 0-padded
    lens: torch.Tensor  # (T,) int32  keys each row sees: its position + 1


def cpu_metadata(batch: DeviceBatch) -> CpuMetadata:
    """The cpu backend's view of the common batch: each row's block table and key count."""
    hb, device = batch.host, batch.slot_mapping.device
    nd, dt, pt = hb.num_decodes, hb.decode_tables, hb.prefill_tables
    width = max(dt.shape[1] if nd else 1, pt.shape[1] if len(pt) else 1)
    tables = np.zeros((hb.num_tokens, width), np.int32)  # (T, width)
    tables[:nd, : dt.shape[1]] = dt[:nd]
    for start, n, table in zip(hb.prefill_q_starts, hb.prefill_q_lens, pt, strict=True):
        tables[start : start + n, : len(table)] = table
    lens = (hb.positions + 1).astype(np.int32)  # NOTE: absolute positions: a row sees keys 0 .. its own
    return CpuMetadata(batch, torch.from_numpy(tables).to(device), torch.from_numpy(lens).to(device))


class CpuBackend(AttentionBackend):
    """The C++ kernels: KV store, every row's attention from the pages, the layers' elementwise work."""

    name = "cpu"
    devices = frozenset({"cpu"})
    auto_dtypes = FLOAT_DTYPES

    @classmethod
    def unavailable(cls) -> str | None:
        from stallfree.engine.kernels import cpu_fused  # noqa: PLC0415 - builds the C++ kernels on first use

        # available() logs why not, once
        return None if cpu_fused.available() else "its C++ kernels cannot be built on this machine"

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from stallfree.engine.kernels import cpu_fused  # noqa: PLC0415 - builds the C++ kernels on first use

        cpu_fused.load()  # raises here, at start-up, when the kernels cannot be built
        super().__init__(cache, num_heads, num_kv_heads, head_dim)
        self.scale = 1.0 / math.sqrt(head_dim)
        self._kernels = cpu_fused

    @property
    def kernels(self) -> ModuleType:
        return self._kernels

    def build_metadata(self, batch: DeviceBatch, padded_decodes: int) -> CpuMetadata:
        return cpu_metadata(batch)

    def bind(self, meta: CpuMetadata, store: bool = True) -> AttentionFn:
        cache, kernels, slots = self.cache, self._kernels, meta.batch.slot_mapping

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: (T, H, D); k, v: (T, KVH, D)
            if store:
                kernels.store_kv(k, v, *cache.flat(layer), slots)
            # NOTE: after the store: a chunk's rows see the chunk's earlier keys in the cache
            return kernels.paged_decode_attention(
                q, cache.k[layer], cache.v[layer], meta.tables, meta.lens, self.scale
            )

        return attend

    def paged_rows(self, meta: CpuMetadata) -> PagedRows:
        """Every row's caches, table and key count: a packed CPU model runs its layers in one C++ call."""
        cache = self.cache
        return PagedRows(cache.k, cache.v, meta.batch.slot_mapping, meta.tables, meta.lens, self.scale)
