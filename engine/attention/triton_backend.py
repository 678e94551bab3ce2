"""The triton backend (the CUDA default): Triton paged-attention kernels, CUDA-graph safe.

It writes the new tokens' K/V into the cache pages first, then attends. It sends decode rows
through its paged split-KV decode kernel (CUDA-graph safe), and prefill chunks, in bf16/fp16, through the
FlashAttention-2 kernel that ships in torch: a chunk's history is gathered from the pages into one
contiguous K/V (a copy of a few MB per layer) and attended with bottom-right causal alignment, which is
that kernel's meaning of `is_causal` when queries are fewer than keys. In fp32 (no FlashAttention) chunks
go through the Triton paged prefill kernel. It never synchronises with the host.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.batch import DeviceBatch
from stallfree.engine.attention.kv_cache import KVCache
from stallfree.engine.kernels import fused
from stallfree.engine.model.llama import AttentionFn

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TritonMetadata:
    batch: DeviceBatch
    decode_splits: int  # split-KV count of the decode kernel (from the padded decode count)


def store_kv(cache: KVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    kf, vf = cache.flat(layer)
    fused.store_kv(k, v, kf, vf, slots)


class TritonBackend(AttentionBackend):
    """Paged decode and prefill kernels of stallfree.engine.kernels.paged_attention."""

    name = "triton"
    devices = frozenset({"cuda"})
    # `auto` takes the torch backend in fp32 (exact); the Triton paged kernels run fp32 when asked by name.
    auto_dtypes = frozenset({torch.bfloat16, torch.float16})
    supports_graphs = True
    compiles_kernels = True
    samples_on_device = True

    @classmethod
    def unsupported(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        # Triton's interpreter runs the kernels on CPU tensors: slow, for tests of the CUDA path.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return super().unsupported(device, dtype)

    @classmethod
    def unavailable(cls) -> str | None:
        return None if fused.triton_available() else "triton is not installed"

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from stallfree.engine.kernels import paged_attention  # noqa: PLC0415 - imports triton

        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
        super().__init__(cache, num_heads, num_kv_heads, head_dim)
        self._paged = paged_attention
        dev = cache.k[0].device
        # Off CUDA (Triton's interpreter, in tests) a nominal 4 SMs keeps the split counts small.
        self.num_sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        )

    @property
    def kernels(self) -> ModuleType:
        return fused

    def splits(self, padded_batch: int) -> int:
        return self._paged.decode_splits(padded_batch, self.num_kv_heads, self.num_sms)

    def build_metadata(self, batch: DeviceBatch, padded_decodes: int) -> TritonMetadata:
        # NOTE: split-KV counts depend on the padded batch size only, so graphs and eager agree.
        return TritonMetadata(batch, self.splits(padded_decodes) if batch.host.num_decodes else 1)

    def decode_fn(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, splits: int
    ) -> AttentionFn:
        """The attention of a decode-only batch (what the CUDA graphs capture)."""
        cache, paged_decode = self.cache, self._paged.paged_decode

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            store_kv(cache, layer, slots, k, v)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, nh, hd)
            return paged_decode(q, cache.k[layer], cache.v[layer], tables, lens, out, splits)

        return attend

    def bind(self, meta: TritonMetadata, store: bool = True) -> AttentionFn:
        if self.cache.k[0].dtype in (torch.bfloat16, torch.float16) and self.cache.k[0].is_cuda:
            return self._bind_flash(meta, store)
        return self._bind_paged(meta, store)

    def _store_and_decode(
        self, meta: TritonMetadata, store: bool, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The part every batch shares: store the new K/V (unless done already), attend for the decode rows
        (the first D). Returns the output (T, nh, hd) with the decode rows filled."""
        batch = meta.batch
        cache, D = self.cache, batch.host.num_decodes
        if store:
            store_kv(cache, layer, batch.slot_mapping, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, nh, hd)
        if D:
            kc, vc = cache.k[layer], cache.v[layer]
            self._paged.paged_decode(
                q[:D], kc, vc, batch.decode_tables, batch.decode_lens, out[:D], meta.decode_splits
            )
        return out

    def _bind_flash(self, meta: TritonMetadata, store: bool) -> AttentionFn:
        batch = meta.batch
        cache, host = self.cache, batch.host
        off = host.prefill_hist_offsets.tolist()
        group = self.num_heads // self.num_kv_heads
        chunks = [
            (int(s), int(n), int(c), off[i], off[i + 1])
            for i, (s, n, c) in enumerate(
                zip(host.prefill_q_starts, host.prefill_q_lens, host.prefill_ctx_lens, strict=True)
            )
        ]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = self._store_and_decode(meta, store, layer, q, k, v)
            kf, vf = cache.flat(layer)
            for s, n, c, h0, h1 in chunks:
                if c == 0:
                    # Nothing cached before it: causal SDPA on the chunk's own K/V, no gather. torch picks
                    # cuDNN's fused kernel here on Hopper, which measured faster than FlashAttention-2.
                    out[s : s + n] = _causal_sdpa(q[s : s + n], k[s : s + n], v[s : s + n], group)
                else:
                    slots = batch.prefill_hist_slots[h0:h1]
                    kk, vv = kf.index_select(0, slots), vf.index_select(0, slots)  # (c + n, nkv, hd)
                    out[s : s + n] = flash_causal(q[s : s + n], kk, vv)
            return out

        return attend

    def _bind_paged(self, meta: TritonMetadata, store: bool) -> AttentionFn:
        batch = meta.batch
        cache, host = self.cache, batch.host
        # NOTE: chunks with nothing cached before them attend only to themselves: torch's fused causal SDPA
        # (FlashAttention) on their own K/V; the others read their history from the pages.
        first = [i for i, c in enumerate(host.prefill_ctx_lens.tolist()) if c == 0]
        fresh = [(int(host.prefill_q_starts[i]), int(host.prefill_q_lens[i])) for i in first]
        paged = len(first) < len(host.prefill_ctx_lens)
        if paged and first:
            keep = np.flatnonzero(host.prefill_ctx_lens > 0)
            sel = torch.from_numpy(keep).to(batch.prefill_q_starts.device, non_blocking=True)
            starts, lens = batch.prefill_q_starts[sel], batch.prefill_q_lens[sel]
            ctxs, tables = batch.prefill_ctx_lens[sel], batch.prefill_tables[sel]
            max_q = int(host.prefill_q_lens[keep].max())
        elif paged:
            starts, lens, ctxs, tables = (
                batch.prefill_q_starts, batch.prefill_q_lens, batch.prefill_ctx_lens, batch.prefill_tables
            )  # fmt: skip
            max_q = int(host.prefill_q_lens.max())
        group, paged_prefill = self.num_heads // self.num_kv_heads, self._paged.paged_prefill

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = self._store_and_decode(meta, store, layer, q, k, v)
            kc, vc = cache.k[layer], cache.v[layer]
            for s, n in fresh:
                out[s : s + n] = _causal_sdpa(q[s : s + n], k[s : s + n], v[s : s + n], group)
            if paged:
                paged_prefill(q, kc, vc, tables, starts, lens, ctxs, max_q, out)
            return out

        return attend


_NATIVE_GQA: dict[tuple[str, torch.dtype], bool] = {}


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2 (torch's build) of q (n, nh, hd) over k, v (S, nkv, hd), S >= n, bottom-right causal:
    query i sees keys 0 .. S - n + i. Returns (n, nh, hd)."""
    group = q.shape[1] // k.shape[1]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, h, L, hd)
    if group > 1 and not _native_gqa(q.device, q.dtype):
        kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
    o = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, True)[0]  # (1, nh, n, hd)
    return o[0].transpose(0, 1)


def _native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's FlashAttention takes fewer K/V heads than query heads as GQA (checked once, on a
    small problem against repeated K/V); else K/V are repeated, a copy of one chunk's history."""
    key = (str(device), dtype)
    if key not in _NATIVE_GQA:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, 4, 5, 64, generator=g, device=device).to(dtype)
        k, v = (torch.randn(1, 2, 9, 64, generator=g, device=device).to(dtype) for _ in range(2))
        ref = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), 0.0, True
        )[0]
        try:
            got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
            _NATIVE_GQA[key] = bool(torch.allclose(got.float(), ref.float(), atol=1e-2))
        except (RuntimeError, ValueError, NotImplementedError):
            _NATIVE_GQA[key] = False
        logger.info("FlashAttention native GQA on %s %s: %s", device, dtype, _NATIVE_GQA[key])
    return _NATIVE_GQA[key]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """Causal attention of one chunk over itself: q (n, nh, hd), k/v (n, nkv, hd) -> (n, nh, hd)."""
    if group > 1:  # FlashAttention wants as many K/V heads as query heads: a cheap copy of one chunk's K/V
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )  # (1, nh, n, hd)
    return o[0].transpose(0, 1)
