"""Attention over the paged KV cache: batch metadata and the two backends.

Per iteration the runner builds one `AttentionMetadata` for the whole ragged batch (decodes first, then
prefill chunks) and binds it to a backend; the model then calls the bound function once per layer with the
new tokens' q/k/v. The function writes k/v into the cache pages and returns attention over each request's
whole history plus the causal part of its current chunk.

NOTE: the causal rule is bottom-right aligned: query i of a chunk that starts at absolute position s sees
keys at positions 0 .. s + i. That is what makes a chunked prefill compute the same thing as a one-shot one.

Metadata is always an explicit argument, never a global.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stallfree.engine.decode_groups import decode_groups
from stallfree.engine.scheduler import SchedulerOutput


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
class AttentionMetadata:
    # FlashInfer's paged description, B requests (decodes first):
    qo_indptr: torch.Tensor  # (B + 1,) int32  offsets of each request's query tokens in the flat batch
    kv_page_indptr: torch.Tensor  # (B + 1,) int32  offsets into kv_page_indices
    kv_page_indices: torch.Tensor  # (pages,) int32  block ids of every request's history, in order
    kv_last_page_len: torch.Tensor  # (B,) int32  tokens used in each request's last page, 1..block_size
    slot_mapping: torch.Tensor  # (T,) int64  cache slot where each new token's k/v goes
    num_decodes: int
    # For the torch backend: decodes in a few padded groups, prefill chunks one by one.
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSpan, ...]
    # For the cpu backend's paged kernel, which then attends for EVERY row (decodes and prefill-chunk
    # tokens alike, no groups, no prefill spans); None otherwise:
    decode_tables: torch.Tensor | None = None  # (T, max pages) int32  each row's request's blocks, 0-padded
    decode_lens: torch.Tensor | None = None  # (T,) int32  keys each row sees: its position + 1


def build_metadata(
    out: SchedulerOutput, block_size: int, device: torch.device, paged_rows: bool = False
) -> AttentionMetadata:
    """Turn the scheduler's chunks into the flat-batch attention description.

    paged_rows: describe every row by its request's block table and the keys it sees (for the cpu
    backend's kernel, which reads the pages in place) instead of decode groups and prefill spans.
    NOTE: same request, same answer: a row at position p is then attended by the same code over the same
    p + 1 keys whether it is a decode, a token of a chunk (any split) or follows a prefix-cache hit."""
    if paged_rows:
        return _paged_rows_metadata(out, block_size, device)
    qo, page_ptr, pages, last_len, slot_chunks = [0], [0], [], [], []
    decode_lens: list[int] = []
    prefills: list[PrefillSpan] = []
    for c in out.chunks:
        kv_len = c.start + c.num_tokens
        n_pages = -(-kv_len // block_size)
        table = np.asarray(c.block_table[:n_pages], dtype=np.int64)
        pos = np.arange(kv_len, dtype=np.int64)
        hist = table[pos // block_size] * block_size + pos % block_size  # (kv_len,) slots of the history
        slot_chunks.append(hist[c.start :])
        if c.is_decode:
            decode_lens.append(kv_len)
        else:
            prefills.append(PrefillSpan(qo[-1], c.num_tokens, c.start, torch.from_numpy(hist).to(device)))
        qo.append(qo[-1] + c.num_tokens)
        pages.append(table)
        page_ptr.append(page_ptr[-1] + n_pages)
        last_len.append(kv_len - (n_pages - 1) * block_size)
    groups = []
    # decodes come first, so decode i is row i and pages[i]
    for members in decode_groups(decode_lens):
        n_pages = len(pages[members[0]])  # the longest history comes first
        blocks = np.zeros((len(members), n_pages), dtype=np.int64)
        mask = np.zeros((len(members), n_pages * block_size), dtype=bool)
        for j, i in enumerate(members):
            blocks[j, : len(pages[i])] = pages[i]
            mask[j, : decode_lens[i]] = True
        groups.append(
            DecodeGroup(
                torch.tensor(members, dtype=torch.int64, device=device),
                torch.from_numpy(blocks).to(device),
                torch.from_numpy(mask).to(device),
            )
        )
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        qo_indptr=torch.tensor(qo, **i32),
        kv_page_indptr=torch.tensor(page_ptr, **i32),
        kv_page_indices=torch.from_numpy(np.concatenate(pages) if pages else np.zeros(0, np.int64)).to(**i32),
        kv_last_page_len=torch.tensor(last_len, **i32),
        slot_mapping=torch.from_numpy(
            np.concatenate(slot_chunks) if slot_chunks else np.zeros(0, np.int64)
        ).to(device),
        num_decodes=len(decode_lens),
        decode_groups=tuple(groups),
        prefills=tuple(prefills),
    )


def _paged_rows_metadata(out: SchedulerOutput, block_size: int, device: torch.device) -> AttentionMetadata:
    """build_metadata for the cpu backend: every row by block table and key count (see paged_rows)."""
    qo, page_ptr, last_len, slots, lens, row_req = [0], [0], [], [], [], []
    tables: list[np.ndarray] = []
    num_decodes = 0
    for i, c in enumerate(out.chunks):
        kv_len = c.start + c.num_tokens
        n_pages = -(-kv_len // block_size)
        table = np.asarray(c.block_table[:n_pages], dtype=np.int64)
        pos = np.arange(c.start, kv_len, dtype=np.int64)  # the new tokens' absolute positions
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        lens.append(pos + 1)
        row_req.append(np.full(c.num_tokens, i, dtype=np.int64))
        tables.append(table)
        num_decodes += c.is_decode
        qo.append(qo[-1] + c.num_tokens)
        page_ptr.append(page_ptr[-1] + n_pages)
        last_len.append(kv_len - (n_pages - 1) * block_size)
    width = max((len(t) for t in tables), default=1)
    per_req = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        per_req[i, : len(t)] = t
    i32 = dict(dtype=torch.int32, device=device)
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt)  # noqa: E731
    return AttentionMetadata(
        qo_indptr=torch.tensor(qo, **i32),
        kv_page_indptr=torch.tensor(page_ptr, **i32),
        kv_page_indices=torch.from_numpy(cat(tables, np.int64)).to(**i32),
        kv_last_page_len=torch.tensor(last_len, **i32),
        slot_mapping=torch.from_numpy(cat(slots, np.int64)).to(device),
        num_decodes=num_decodes,
        decode_groups=(),
        prefills=(),
        decode_tables=torch.from_numpy(per_req[cat(row_req, np.int64)]).to(device),  # (T, width)
        decode_lens=torch.from_numpy(cat(lens, np.int64).astype(np.int32)).to(device),
    )


class KVCache:
    """Per layer one K and one V tensor of shape (num_blocks, block_size, num_kv_heads, head_dim).

    Separate K and V tensors (FlashInfer's NHD tuple layout) keep each one's flat slot view contiguous.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_blocks * block_size, num_kv_heads, head_dim) views of one layer's K and V."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, k.shape[2], k.shape[3]), v.view(-1, v.shape[2], v.shape[3])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kf, vf = self.flat(layer)
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))


class TorchAttention:
    """Exact attention in plain torch (CPU, and the reference on any device).

    GQA without repeating K/V: decodes (in groups, see stallfree.engine.decode_groups) and prefill chunks
    both use SDPA's enable_gqa, which shares each KV head across its query heads.

    With `kernels` (stallfree.engine.kernels.cpu_fused: the `cpu` backend) the KV store runs in the C++
    kernel, and so does the attention of every row, decodes and prefill-chunk tokens alike, when
    build_metadata described them by block table (paged_rows): one code path per row is what makes a
    row's result independent of its batch, its chunk split and prefix-cache hits (SDPA's blocked softmax
    over a chunk rounds differently from a decode's).
    """

    def __init__(
        self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, kernels=None
    ) -> None:
        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kernels = kernels
        self.name = "torch" if kernels is None else "cpu"

    def bind(self, meta: AttentionMetadata):
        cache, kernels = self.cache, self.kernels
        paged = meta.decode_tables is not None  # every row through the kernel (else groups and spans)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: (T, H, D); k, v: (T, KVH, D)
            kf, vf = cache.flat(layer)
            if kernels is None:
                cache.write(layer, meta.slot_mapping, k, v)
            else:
                kernels.store_kv(k, v, kf, vf, meta.slot_mapping)
            if paged:  # NOTE: after the store: a chunk's rows see the chunk's earlier keys in the cache
                return kernels.paged_decode_attention(
                    q, cache.k[layer], cache.v[layer], meta.decode_tables, meta.decode_lens, self.scale
                )
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


class FlashInferAttention:
    """CUDA backend: FlashInfer's paged prefill wrapper fed the same metadata (decodes are q_len 1).

    Written against flashinfer's BatchPrefillWithPagedKVCacheWrapper (NHD layout, (K, V) tuple cache). It
    can only run where CUDA and flashinfer are present; the torch backend is the reference it is checked
    against on a GPU machine.
    """

    name = "flashinfer"

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import flashinfer  # noqa: PLC0415 - optional, CUDA only

        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        device = cache.k[0].device
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")

    def bind(self, meta: AttentionMetadata):
        dtype = self.cache.k[0].dtype
        self._wrapper.plan(
            meta.qo_indptr,
            meta.kv_page_indptr,
            meta.kv_page_indices,
            meta.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.cache.block_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.write(layer, meta.slot_mapping, k, v)
            return self._wrapper.run(q.to(dtype), (self.cache.k[layer], self.cache.v[layer])).to(q.dtype)

        return attend


def make_attention(backend: str, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int):
    """`auto` picks flashinfer on CUDA in bf16/fp16 when it is installed (it has no fp32 kernels), else torch."""
    on_cuda = cache.k[0].is_cuda
    if backend == "auto":
        backend = "torch"
        if on_cuda and cache.k[0].dtype != torch.float32:
            try:
                import flashinfer  # noqa: F401, PLC0415

                backend = "flashinfer"
            except ImportError:
                pass
    if backend == "flashinfer":
        if not on_cuda:
            raise ValueError(
                "the flashinfer attention backend needs a CUDA device; use attention_backend='torch'"
            )
        return FlashInferAttention(cache, num_heads, num_kv_heads, head_dim)
    if backend == "torch":
        return TorchAttention(cache, num_heads, num_kv_heads, head_dim)
    if backend == "cpu":
        from stallfree.engine.kernels import cpu_fused  # noqa: PLC0415

        cpu_fused.load()  # raises here, at start-up, when the kernels cannot be built
        return TorchAttention(cache, num_heads, num_kv_heads, head_dim, kernels=cpu_fused)
    raise ValueError(f"unknown attention backend {backend!r}; choose auto, torch, cpu or flashinfer")
