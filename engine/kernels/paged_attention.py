"""Paged attention in Triton: decode rows (split-KV) and prefill chunks (bottom-right causal), on CUDA.

The KV cache of a layer is two tensors (num_blocks, block_size, nkv, hd) (stallfree.engine.attention.KVCache);
a request's keys live in the pages its block table lists, in order. Grouped-query attention never repeats
K/V: one program handles one KV head and all G = nh / nkv query heads that read it, so each key is loaded
once per program.

- `paged_decode`: one query per request. The history is cut into `num_splits` ranges, each program
  (request, kv head, split) attends over its range (online softmax) and writes a partial output and its
  log-sum-exp; a second kernel merges the splits. The split count depends only on the (padded) batch
  size, never on lengths, so one CUDA graph per batch size replays for any context.
- `paged_prefill`: prefill chunks that start after `ctx_len` cached tokens. Query i of a chunk (absolute
  position ctx_len + i) sees keys 0 .. ctx_len + i, read from the pages (the chunk's own k/v were written
  there first). Rows of a tile are (token, head-in-group) pairs, so the G heads share each loaded key tile.

NOTE: lengths, tables and offsets are read on the device; nothing here synchronises with the host, so both
kernels can be captured in CUDA graphs. Rows whose seq_len is 0 (padding) produce zeros.
"""

from __future__ import annotations

import math
import os

import torch

try:  # Triton ships with torch's CUDA wheels; without it the torch backend is used.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # UPCAST: Triton's CPU interpreter multiplies bf16 tiles wrongly, so there both sides go to fp32
        # first (exact: a bf16 x bf16 product fits fp32, as on the tensor cores). Compiled code never upcasts.
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _attend_tile(
        q, k_ptr, v_ptr, table_ptr, pos, pmask, allowed, m_i, l_i, acc,
        stride_kb, stride_ks, stride_kh, h, scale_log2e,
        HD: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """One online-softmax step over the keys at positions `pos` (read through one block table row):
        rows of q (R, HD) see the keys where `allowed` (R, N) holds. Returns the updated (m_i, l_i, acc)."""
        d = tl.arange(0, HD)
        page = tl.load(table_ptr + pos // BS, mask=pmask, other=0).to(tl.int64)
        off = page * stride_kb + (pos % BS) * stride_ks + h * stride_kh  # (N,)
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)  # (N, HD)
        qk = _dot(q, tl.trans(k), IEEE, UPCAST)
        qk = tl.where(allowed, qk * scale_log2e, float("-inf"))  # (R, N), log2 units
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        return m_new, l_i, acc

    # Table widths change every iteration: not specialising on them avoids recompiling while serving.
    @triton.jit(do_not_specialize=["stride_tb"])
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, o_part_ptr, lse_part_ptr,
        stride_qt, stride_qh, stride_tb, stride_kb, stride_ks, stride_kh, num_heads, scale_log2e,
        NUM_SPLITS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, seq_len)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        gmask = g < G
        q = tl.load(
            q_ptr + b * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )  # (GP, HD)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, HD], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            m_i, l_i, acc = _attend_tile(
                q, k_ptr, v_ptr, tables_ptr + b * stride_tb, pos, pmask, pmask[None, :], m_i, l_i, acc,
                stride_kb, stride_ks, stride_kh, h, scale_log2e, HD, BS, IEEE, UPCAST,
            )  # fmt: skip
        nonempty = end > start
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (b * num_heads + h * G + g) * NUM_SPLITS + s  # (GP,) index into (B, nh, S)
        tl.store(lse_part_ptr + row, lse, mask=gmask)
        tl.store(o_part_ptr + row[:, None] * HD + d[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _decode_merge_kernel(
        o_part_ptr, lse_part_ptr, out_ptr, stride_ot, stride_oh, num_heads,
        NUM_SPLITS: tl.constexpr, SP: tl.constexpr, HD: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        hq = tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, HD)
        smask = s < NUM_SPLITS
        base = (b * num_heads + hq) * NUM_SPLITS
        lse = tl.load(lse_part_ptr + base + s, mask=smask, other=float("-inf"))  # (SP,)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # 0 for empty splits
        total = tl.sum(w, 0)
        o = tl.load(o_part_ptr + (base + s)[:, None] * HD + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ot + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["stride_tb"])
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_kb, stride_ks, stride_kh, scale_log2e,
        G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0)
        mt = tl.program_id(1)
        h = tl.program_id(2)
        q_len = tl.load(q_lens_ptr + c)
        if mt * BLOCK_M < q_len:
            q_start = tl.load(q_starts_ptr + c)
            ctx = tl.load(ctx_lens_ptr + c)
            r = tl.arange(0, BLOCK_M * GP)
            tok = mt * BLOCK_M + r // GP  # (M,) token of each row within the chunk
            g = r % GP
            rmask = (tok < q_len) & (g < G)
            d = tl.arange(0, HD)
            qrow = (q_start + tok).to(tl.int64)
            q = tl.load(
                q_ptr + qrow[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None],
                other=0.0,
            )  # (M, HD)
            qpos = ctx + tok  # NOTE: absolute positions; a row sees keys 0 .. qpos (bottom-right causal)
            kv_end = ctx + tl.minimum((mt + 1) * BLOCK_M, q_len)
            m_i = tl.full([BLOCK_M * GP], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M * GP], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M * GP, HD], dtype=tl.float32)
            for n0 in range(0, kv_end, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                pmask = pos < kv_end
                allowed = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
                m_i, l_i, acc = _attend_tile(
                    q, k_ptr, v_ptr, tables_ptr + c * stride_tb, pos, pmask, allowed, m_i, l_i, acc,
                    stride_kb, stride_ks, stride_kh, h, scale_log2e, HD, BS, IEEE, UPCAST,
                )  # fmt: skip
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + qrow[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=rmask[:, None],
            )


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if triton is None:
        raise RuntimeError("triton is not installed: use the torch attention backend")
    _, nh, hd = q.shape
    _, bs, nkv, hd_k = k_cache.shape
    if hd != hd_k or nh % nkv:
        raise ValueError(f"query heads {nh}x{hd} do not match cache heads {nkv}x{hd_k}")
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {hd}")
    if q.stride(2) != 1 or not k_cache.is_contiguous():
        raise ValueError("q must have a contiguous last dimension and the cache must be contiguous")
    return nh, nkv, hd, bs


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """Splits of each history so that (batch x kv heads x splits) programs fill the GPU about 4 times."""
    return max(1, min(max_splits, -(-4 * num_sms // max(1, batch_size * num_kv_heads))))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    scale: float | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one query per request over its paged history.

    q, out: (B, nh, hd) (last dim contiguous); k_cache, v_cache: (num_blocks, block_size, nkv, hd);
    block_tables: (B, max_pages) int32/int64; seq_lens: (B,) keys per request, new token included (0 =
    padding row, output zeros). block_n: keys per tile. Returns `out`.
    """
    nh, nkv, hd, bs = _check(q, k_cache)
    B = q.shape[0]
    G = nh // nkv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    o_part = torch.empty((B, nh, num_splits, hd), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, nh, num_splits), dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    args = (
        q, k_cache, v_cache, block_tables, seq_lens, o_part, lse,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), nh, scale * LOG2E,
    )  # fmt: skip
    meta = dict(
        NUM_SPLITS=num_splits, G=G, GP=max(16, _next_pow2(G)), HD=hd, BS=bs, IEEE=ieee, UPCAST=_INTERPRET
    )
    # NOTE: 64-key tiles and 4 warps measured best on the H200 (docs/gpu.md); tuning at warm-up on dummy
    # lengths picked worse tiles, so the choice is fixed.
    _decode_split_kernel[(B, nkv, num_splits)](*args, **meta, BLOCK_N=block_n, num_warps=4)
    _decode_merge_kernel[(B, nh)](
        o_part, lse, out, out.stride(0), out.stride(1), nh,
        NUM_SPLITS=num_splits, SP=_next_pow2(num_splits), HD=hd, num_warps=4,
    )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_q_len: int,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention for C prefill chunks of a flat batch, each over its cached history plus its causal part.

    q, out: (T, nh, hd) for the whole flat batch; chunk c owns rows q_starts[c] .. + q_lens[c], and
    ctx_lens[c] of its tokens were cached before it (its own k/v must already be in the cache);
    block_tables: (C, max_pages); max_q_len: an upper bound of q_lens known on the host (sizes the grid).
    Writes only the chunks' rows of `out` and returns it.
    """
    nh, nkv, hd, bs = _check(q, k_cache)
    C = q_starts.shape[0]
    G = nh // nkv
    GP = _next_pow2(G)
    ieee = q.dtype == torch.float32
    block_m = max(1, (64 if ieee else 128) // GP)  # tokens per tile; a tile has block_m * GP >= 16 rows
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    grid = (C, triton.cdiv(max_q_len, block_m), nkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, ctx_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2E,
        G=G, GP=GP, HD=hd, BS=bs, BLOCK_M=block_m, BLOCK_N=64 if not ieee else 32, IEEE=ieee, UPCAST=_INTERPRET,
        num_warps=8 if block_m * GP >= 128 else 4,
        num_stages=2,
    )  # fmt: skip
    return out
