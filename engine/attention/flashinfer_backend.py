"""The flashinfer backend (a CUDA option): FlashInfer's paged decode and prefill kernels, planned once per
iteration from the host batch. It has no float32 kernels and does not run inside CUDA graphs here."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np
import torch

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.batch import DeviceBatch
from stallfree.engine.attention.kv_cache import KVCache
from stallfree.engine.kernels import fused
from stallfree.engine.model.llama import AttentionFn


class FlashInferBackend(AttentionBackend):
    """FlashInfer: decode rows through its paged decode kernel, prefill chunks through its paged prefill
    kernel, both planned once per iteration from host arrays (nothing is read back from the GPU to plan)."""

    name = "flashinfer"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})  # no float32 kernels; `auto` never picks it
    compiles_kernels = True
    samples_on_device = True

    @classmethod
    def unavailable(cls) -> str | None:
        return None if importlib.util.find_spec("flashinfer") else "flashinfer is not installed"

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import flashinfer  # noqa: PLC0415 - optional, CUDA only

        super().__init__(cache, num_heads, num_kv_heads, head_dim)
        dev = cache.k[0].device
        self._ws_decode = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        self._ws_prefill = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._ws_decode, kv_layout="NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws_prefill, kv_layout="NHD")

    @property
    def kernels(self) -> ModuleType:
        return fused

    def _paged(self, lens: np.ndarray, tables: np.ndarray, device: torch.device):
        """FlashInfer's (indptr, indices, last_page_len) for requests with `lens` keys: indptr and
        last_page_len stay on the host (plan reads them there), indices go to the device."""
        bs = self.cache.block_size
        pages = -(-lens // bs)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate([tables[i, :p] for i, p in enumerate(pages)]).astype(np.int32)
        last = (lens - (pages - 1) * bs).astype(np.int32)
        dev_indices = torch.from_numpy(indices).pin_memory().to(device, non_blocking=True)
        return torch.from_numpy(indptr), dev_indices, torch.from_numpy(last)

    def build_metadata(self, batch: DeviceBatch, padded_decodes: int) -> DeviceBatch:
        """Plans both wrappers for this batch; the metadata is the batch itself."""
        cache, host = self.cache, batch.host
        D, dtype, dev = host.num_decodes, cache.k[0].dtype, cache.k[0].device
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, cache.block_size)
        if D:
            indptr, indices, last = self._paged(host.decode_lens, host.decode_tables, dev)
            self._decode.plan(indptr, indices, last, *shape, q_data_type=dtype, kv_data_type=dtype)
        C = len(host.prefill_q_lens)
        if C:
            kv_lens = host.prefill_ctx_lens + host.prefill_q_lens
            indptr, indices, last = self._paged(kv_lens, host.prefill_tables, dev)
            qo = np.concatenate([[0], np.cumsum(host.prefill_q_lens)]).astype(np.int32)
            self._prefill.plan(
                torch.from_numpy(qo), indptr, indices, last, *shape, causal=True,
                q_data_type=dtype, kv_data_type=dtype,
            )  # fmt: skip
        return batch

    def bind(self, batch: DeviceBatch, store: bool = True) -> AttentionFn:
        cache, host = self.cache, batch.host
        D, C = host.num_decodes, len(host.prefill_q_lens)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if store:
                fused.store_kv(k, v, *cache.flat(layer), batch.slot_mapping)
            kv = (cache.k[layer], cache.v[layer])
            parts = []
            if D:
                parts.append(self._decode.run(q[:D].contiguous(), kv))
            if C:
                parts.append(self._prefill.run(q[D:].contiguous(), kv))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return attend
