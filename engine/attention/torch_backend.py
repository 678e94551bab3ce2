"""The torch backend: exact attention in plain torch, the reference on any device.

GQA without repeating K/V: decodes (in padded groups, see stallfree.engine.decode_groups) and prefill chunks
both use SDPA's enable_gqa, which shares each KV head across its query heads. (The cpu backend, in
cpu_backend.py, sends every row through its C++ paged kernel instead.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stallfree.engine.attention.backend import FLOAT_DTYPES, AttentionBackend
from stallfree.engine.attention.batch import DeviceBatch
from stallfree.engine.attention.kv_cache import KVCache
from stallfree.engine.decode_groups import decode_groups
from stallfree.engine.model.llama import AttentionFn


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    q_start: int  # offset of the chunk's first token in the flat batch
    q_len: int
    context_len: int  # tokens already in the cache before this chunk (= its first absolute position)
    kv_slots: torch.Tensor  # (context_len + q_len,) int64 cache slots of the whole history, in order


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decodes attended as one padded batch (see stallfree.engine.decode_groups)."""

    rows: torch.Tensor  # (g,) int64  the decodes' rows in the flat batch
    blocks: torch.Tensor  # (g, P) int64  each decode's block table, padded with block 0
    mask: torch.Tensor  # (g, P * block_size) bool, True where a key is real


@dataclass(frozen=True, slots=True)
class TorchMetadata:
    slot_mapping: torch.Tensor  # (T,) int64  cache slot where each new token's k/v goes
    num_decodes: int
    decode_groups: tuple[DecodeGroup, ...]  # decodes in a few padded groups
    prefills: tuple[PrefillSpan, ...]  # prefill chunks one by one


def torch_metadata(batch: DeviceBatch, block_size: int) -> TorchMetadata:
    """The torch backend's view of the common batch: prefill spans over their history slots and the decodes
    in padded groups."""
    hb, device = batch.host, batch.slot_mapping.device
    off = hb.prefill_hist_offsets.tolist()
    prefills = tuple(
        PrefillSpan(int(s), int(n), int(c), batch.prefill_hist_slots[off[i] : off[i + 1]])
        for i, (s, n, c) in enumerate(
            zip(hb.prefill_q_starts, hb.prefill_q_lens, hb.prefill_ctx_lens, strict=True)
        )
    )
    lens = hb.decode_lens.tolist()
    groups = []
    # decodes come first, so decode i is row i; its table row is 0-padded past its own pages
    for members in decode_groups(lens):
        n_pages = -(-lens[members[0]] // block_size)  # the longest history comes first
        mask = np.zeros((len(members), n_pages * block_size), dtype=bool)
        for j, i in enumerate(members):
            mask[j, : lens[i]] = True
        groups.append(
            DecodeGroup(
                torch.tensor(members, dtype=torch.int64, device=device),
                torch.from_numpy(np.ascontiguousarray(hb.decode_tables[members, :n_pages])).to(device),
                torch.from_numpy(mask).to(device),
            )
        )
    return TorchMetadata(batch.slot_mapping, hb.num_decodes, tuple(groups), prefills)


class TorchBackend(AttentionBackend):
    """Exact attention in plain torch (CPU, and the reference on any device)."""

    name = "torch"
    devices = frozenset({"cpu", "cuda"})
    auto_dtypes = FLOAT_DTYPES  # what `auto` falls back to anywhere

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(cache, num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def build_metadata(self, batch: DeviceBatch, padded_decodes: int) -> TorchMetadata:
        return torch_metadata(batch, self.cache.block_size)

    def bind(self, meta: TorchMetadata, store: bool = True) -> AttentionFn:
        cache = self.cache

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: (T, H, D); k, v: (T, KVH, D)
            kf, vf = cache.flat(layer)
            if store:
                cache.write(layer, meta.slot_mapping, k, v)
            out = torch.empty_like(q)
            for grp in meta.decode_groups:
                g, n_pages = grp.blocks.shape
                # Whole pages, gathered with index_select (2-3x faster than advanced indexing here).
                pages = grp.blocks.view(-1)
                kp = cache.k[layer].index_select(0, pages).view(g, -1, *kf.shape[1:])  # (g, L, KVH, hd)
                vp = cache.v[layer].index_select(0, pages).view(g, -1, *vf.shape[1:])
                if len(meta.decode_groups) == 1 and not meta.prefills and g == q.shape[0]:
                    # One group, nothing else: its rows are a permutation of the whole batch.
                    out.index_copy_(0, grp.rows, self._decode(q.index_select(0, grp.rows), kp, vp, grp.mask))
                else:
                    out[grp.rows] = self._decode(q[grp.rows], kp, vp, grp.mask)
            for p in meta.prefills:
                sl = slice(p.q_start, p.q_start + p.q_len)
                out[sl] = self._prefill(q[sl], kf[p.kv_slots], vf[p.kv_slots], p.context_len)
            return out

        return attend

    def _decode(self, q, keys, vals, mask) -> torch.Tensor:
        # q: (D, H, hd); keys/vals: (D, L, KVH, hd), gathered a whole page at a time; mask (D, L) marks the
        # real keys. One query per decode through SDPA with enable_gqa (docs/engine.md measures it against
        # the padded einsums it replaced).
        qq = q[:, :, None, :]  # (D, H, 1, hd)
        kk = keys.to(q.dtype).transpose(1, 2)  # (D, KVH, L, hd)
        vv = vals.to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True
        )
        return o[:, :, 0, :]

    def _prefill(self, q, keys, vals, context_len: int) -> torch.Tensor:
        # q: (n, H, hd); keys/vals: (L, KVH, hd) with L = context_len + n
        n, big_l = q.shape[0], keys.shape[0]
        qq = q.transpose(0, 1)[None]  # (1, H, n, hd)
        kk = keys.to(q.dtype).transpose(0, 1)[None]  # (1, KVH, L, hd): enable_gqa shares it across g heads
        vv = vals.to(q.dtype).transpose(0, 1)[None]
        if context_len == 0:
            # A whole prompt or a first chunk: plain causal, which lets the kernel skip the masked half.
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            # Query i (absolute position context_len + i) sees keys 0 .. context_len + i.
            qpos = torch.arange(n, device=q.device) + context_len
            allowed = torch.arange(big_l, device=q.device)[None, :] <= qpos[:, None]  # (n, L)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=allowed, scale=self.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)  # (n, H, hd)
