"""The Triton paged-attention kernels against a float64 softmax over each request's own history.

Without a GPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET) on CPU
tensors; on a CUDA machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from stallfree.engine.kernels.paged_attention import decode_splits, paged_decode, paged_prefill

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _cache(num_blocks, bs, nkv, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(DEVICE, dtype)
    v = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(DEVICE, dtype)
    return k, v


def _tables(lengths, bs, num_blocks, seed=1):
    """Shuffled, disjoint pages per request, padded with 0."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    pages = [[perm.pop() for _ in range(-(-n // bs))] for n in lengths]
    width = max(len(p) for p in pages)
    t = torch.zeros(len(lengths), width, dtype=torch.int32)
    for i, p in enumerate(pages):
        t[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    return t.to(DEVICE)


def _reference(q, k_cache, v_cache, table, kv_len, qpos):
    """q (n, nh, hd) at absolute positions qpos (n,), keys 0..qpos of one request; float64."""
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    nh, hd = q.shape[1], q.shape[2]
    pos = torch.arange(kv_len, device=q.device)
    slots = table[pos // bs].long() * bs + pos % bs
    keys = k_cache.reshape(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, dim=1)  # (L, nh, hd)
    vals = v_cache.reshape(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), keys) / math.sqrt(hd)
    s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vals)


@pytest.mark.parametrize(
    "dtype,nh,nkv,hd",
    [(torch.float32, 9, 3, 64), (torch.bfloat16, 8, 2, 128), (torch.float16, 4, 4, 32)],
    ids=["fp32-gqa3-hd64", "bf16-gqa4-hd128", "fp16-mha-hd32"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_matches_a_float64_softmax(dtype, nh, nkv, hd, num_splits):
    bs, num_blocks = 16, 64
    lengths = [1, 17, 150, 0, 64]  # a zero length is a padding row
    k_cache, v_cache = _cache(num_blocks, bs, nkv, hd, dtype)
    table = _tables([max(n, 1) for n in lengths], bs, num_blocks)
    # q as a strided view of a fused qkv row, as the model hands it over
    qkv = torch.randn(len(lengths), (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(2))
    q = qkv.to(DEVICE, dtype)[:, : nh * hd].view(len(lengths), nh, hd)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(lengths), nh, hd), float("nan"), dtype=dtype, device=DEVICE)
    paged_decode(q, k_cache, v_cache, table, seq_lens, out, num_splits=num_splits, block_n=16)
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.all(out[i] == 0), "a padding row must give zeros"
            continue
        ref = _reference(q[i : i + 1], k_cache, v_cache, table[i], n, torch.tensor([n - 1], device=DEVICE))
        err = (out[i : i + 1].double() - ref).abs().max().item()
        assert err < TOL[dtype], f"request {i} (length {n}): max error {err}"


@pytest.mark.parametrize(
    "dtype,nh,nkv,hd",
    [(torch.float32, 9, 3, 64), (torch.bfloat16, 8, 2, 128)],
    ids=["fp32-gqa3-hd64", "bf16-gqa4-hd128"],
)
def test_paged_prefill_is_bottom_right_causal_over_the_history(dtype, nh, nkv, hd):
    bs, num_blocks = 16, 64
    # (context already cached, chunk length): a first chunk, chunks after a page-aligned and an unaligned
    # history, and a one-token chunk.
    chunks = [(0, 37), (32, 20), (45, 70), (100, 1)]
    k_cache, v_cache = _cache(num_blocks, bs, nkv, hd, dtype, seed=3)
    table = _tables([c + n for c, n in chunks], bs, num_blocks, seed=4)
    T = sum(n for _, n in chunks)
    q = torch.randn(T, nh, hd, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor([n for _, n in chunks]), 0)[:-1].tolist()])
    q_starts = starts.to(DEVICE)
    q_lens = torch.tensor([n for _, n in chunks], device=DEVICE)
    ctx = torch.tensor([c for c, _ in chunks], device=DEVICE)
    out = torch.full((T, nh, hd), float("nan"), dtype=dtype, device=DEVICE)
    paged_prefill(q, k_cache, v_cache, table, q_starts, q_lens, ctx, max(n for _, n in chunks), out)
    for i, (c, n) in enumerate(chunks):
        s = int(starts[i])
        qpos = torch.arange(c, c + n, device=DEVICE)
        ref = _reference(q[s : s + n], k_cache, v_cache, table[i], c + n, qpos)
        err = (out[s : s + n].double() - ref).abs().max().item()
        assert err < TOL[dtype], f"chunk {i} (context {c}, {n} tokens): max error {err}"


def test_decode_split_count_fills_the_gpu_and_stays_bounded():
    assert decode_splits(1, 8, 132) == 32
    assert decode_splits(128, 8, 132) == 1
    assert 1 <= decode_splits(32, 8, 132) <= 3
