"""The fused Triton kernels against their torch references and against the model's own layers.

On CUDA the compiled kernels run on the GPU; elsewhere CPU tensors go through Triton's interpreter (set up
in conftest.py), so shapes stay tiny. Tolerances:
  - float32: 1e-5 (relative and absolute), summation order and sigmoid/rsqrt formulas differing;
  - bfloat16 / float16: one rounding of the dtype (rtol = its eps: kernel and reference round the same
    fp32 value, or values a few fp32 ulps apart, to the nearest representable), plus 1e-5 absolute for
    those fp32-level differences where a result cancels to near zero;
  - exact where nothing is computed (store_kv, the residual sum, untouched memory).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import Tensor

from stallfree.engine.kernels import fused
from stallfree.engine.model.llama import RMSNorm, apply_rotary, rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.parametrize("device", [DEVICE])

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-5


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int = 0, scale: float = 1.0) -> Tensor:
    """Seeded normal values made on the CPU (the same on every device), then moved."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)


def assert_matches_ref(actual: Tensor, expected: Tensor) -> None:
    """Within the module docstring's tolerance for the dtype; 16-bit results also mostly bit-identical."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == F32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=torch.finfo(actual.dtype).eps, atol=1e-5
    )
    # The same roundings of (nearly) the same fp32 values agree bit for bit except near a rounding
    # boundary; an extra or missing rounding step leaves about a quarter of the elements one ulp off.
    identical = (actual == expected).float().mean().item()
    assert identical >= 0.99, f"only {identical:.1%} bit-identical: a rounding step differs"


def make_qkv(T: int, nh: int, nkv: int, hd: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A fused qkv projection output (T, nh*hd + 2*nkv*hd) and its q, k, v head views (strided rows)."""
    qkv = randn(T, (nh + 2 * nkv) * hd, dtype=dtype, device=device, seed=seed)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    return qkv, q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)


def make_rope_caches(hd: int, max_pos: int, device: str) -> tuple[Tensor, Tensor]:
    """cos/sin caches (max_pos, hd/2) float32, built as the model's RotaryEmbedding builds them."""
    freqs = torch.outer(torch.arange(max_pos, dtype=F32), rope_inv_freq(hd, 1e4))
    return freqs.cos().to(device), freqs.sin().to(device)


# --- add_rmsnorm -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=dtype_id)
@pytest.mark.parametrize("T, C", [(1, 576), (3, 96), (17, 576), (2, 8192)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_ref(device, dtype, T, C, with_residual):
    x = randn(T, C, dtype=dtype, device=device, seed=1)
    residual = randn(T, C, dtype=dtype, device=device, seed=2, scale=3.0) if with_residual else None
    weight = (1 + randn(C, dtype=F32, device=device, seed=3, scale=0.2)).to(dtype)
    out, new_residual = fused.add_rmsnorm(x, residual, weight, EPS)
    want_out, want_residual = fused.add_rmsnorm_ref(x, residual, weight, EPS)
    if residual is None:
        assert new_residual is x  # no copy
    else:
        assert torch.equal(new_residual, want_residual)  # one rounding of an exact fp32 sum: bit-identical
    assert_matches_ref(out, want_out)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=dtype_id)
def test_add_rmsnorm_matches_the_model_rmsnorm(device, dtype):
    """Same rounding order as llama.RMSNorm applied to x + residual: fp32 within 1e-6, 16-bit one rounding."""
    T, C = 5, 576
    norm = RMSNorm(C, EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(C, dtype=F32, device=device, seed=4, scale=0.2))
    x = randn(T, C, dtype=dtype, device=device, seed=5)
    residual = randn(T, C, dtype=dtype, device=device, seed=6, scale=3.0)
    with torch.no_grad():
        want_residual = x + residual
        want = norm(want_residual)
    out, new_residual = fused.add_rmsnorm(x, residual, norm.weight.detach(), EPS)
    assert torch.equal(new_residual, want_residual)
    if dtype == F32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        assert_matches_ref(out, want)


# --- silu_and_mul ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=dtype_id)
@pytest.mark.parametrize("T, inter", [(1, 96), (3, 1100), (17, 576)])
def test_silu_and_mul_matches_ref(device, dtype, T, inter):
    x = randn(T, 2 * inter, dtype=dtype, device=device, seed=7, scale=2.0)  # (T, 2I): gate | up
    out = fused.silu_and_mul(x)  # (T, I)
    assert_matches_ref(out, fused.silu_and_mul_ref(x))


# --- rope_ -----------------------------------------------------------------------------------------------

HEADS = [(9, 3, 64), (8, 2, 128)]  # (nh, nkv, hd): SmolLM2-135M and Llama-3-8B-like


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=dtype_id)
@pytest.mark.parametrize("nh, nkv, hd", HEADS)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_rope_matches_ref_on_strided_views_of_fused_qkv(device, dtype, nh, nkv, hd, T):
    cos, sin = make_rope_caches(hd, 4096, device)
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T)).to(device)
    qkv, q, k, _ = make_qkv(T, nh, nkv, hd, dtype, device, seed=8)
    want_qkv, want_q, want_k, _ = make_qkv(T, nh, nkv, hd, dtype, device, seed=8)
    if T > 1:  # rows of the fused output, not a contiguous (T, nh, hd) (a lone row's stride is moot)
        assert q.stride() == (qkv.shape[1], hd, 1)
    fused.rope_(q, k, positions, cos, sin)
    fused.rope_ref(want_q, want_k, positions, cos, sin)
    assert_matches_ref(q, want_q)
    assert_matches_ref(k, want_k)
    v_cols = slice((nh + nkv) * hd, None)
    assert torch.equal(qkv[:, v_cols], want_qkv[:, v_cols])  # v untouched


@pytest.mark.parametrize("nh, nkv, hd", HEADS)
def test_rope_matches_the_model_apply_rotary_in_bf16(device, nh, nkv, hd):
    """apply_rotary computes in bf16 (three roundings), the kernel in fp32 (one): a few bf16 ulps apart."""
    T = 17
    cos, sin = make_rope_caches(hd, 4096, device)
    positions = torch.arange(1000, 1000 + T, device=device)
    _, q, k, _ = make_qkv(T, nh, nkv, hd, BF16, device, seed=9)
    want_q = apply_rotary(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_k = apply_rotary(k, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    fused.rope_(q, k, positions, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k, want_k, rtol=2e-2, atol=2e-2)


# --- store_kv --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, cache_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F32, BF16)]
)
@pytest.mark.parametrize("nh, nkv, hd, T", [(9, 3, 64, 17), (8, 2, 128, 3)])
def test_store_kv_skips_negative_slots_and_leaves_other_rows(device, dtype, cache_dtype, nh, nkv, hd, T):
    num_slots = 4 * 16  # 4 blocks of 16 tokens, flattened
    _, _, k, v = make_qkv(T, nh, nkv, hd, dtype, device, seed=10)
    g = torch.Generator().manual_seed(11)
    slot_mapping = torch.randperm(num_slots - 1, generator=g)[:T]  # never the last slot (see below)
    slot_mapping[::2] = -1  # padding rows
    slot_mapping = slot_mapping.to(device)
    k_cache = randn(num_slots, nkv, hd, dtype=cache_dtype, device=device, seed=12)
    v_cache = randn(num_slots, nkv, hd, dtype=cache_dtype, device=device, seed=13)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    fused.store_kv(k, v, k_cache, v_cache, slot_mapping)
    fused.store_kv_ref(k, v, want_k_cache, want_v_cache, slot_mapping)
    assert torch.equal(k_cache, want_k_cache)
    assert torch.equal(v_cache, want_v_cache)
    # NOTE: slot -1 would index the last row in torch; the kernel must skip it, not write there.
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slot_mapping[slot_mapping >= 0]] = False
    assert untouched[-1]
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


# --- edges: empty batches, bad inputs, no triton ---------------------------------------------------------


def test_empty_batches_launch_nothing(device):
    x = torch.empty(0, 96, device=device)
    out, new_residual = fused.add_rmsnorm(x, x, torch.ones(96, device=device), EPS)
    assert out.shape == new_residual.shape == (0, 96)
    assert fused.silu_and_mul(torch.empty(0, 192, device=device)).shape == (0, 96)
    _, q, k, v = make_qkv(0, 2, 1, 64, F32, device)
    cos, sin = make_rope_caches(64, 8, device)
    fused.rope_(q, k, torch.empty(0, dtype=torch.long, device=device), cos, sin)
    cache = torch.zeros(4, 1, 64, device=device)
    fused.store_kv(k, v, cache, cache.clone(), torch.empty(0, dtype=torch.long, device=device))


def test_bad_shapes_and_dtypes_raise_value_error(device):
    x = torch.zeros(2, 96, device=device)
    with pytest.raises(ValueError, match="weight"):
        fused.add_rmsnorm(x, None, torch.ones(95, device=device), EPS)
    with pytest.raises(ValueError, match="2I"):
        fused.silu_and_mul(torch.zeros(2, 97, device=device))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused.silu_and_mul(torch.zeros(2, 96, dtype=torch.long, device=device))
    _, q, k, v = make_qkv(2, 2, 1, 64, F32, device)
    cos, sin = make_rope_caches(64, 8, device)
    with pytest.raises(ValueError, match="positions"):
        fused.rope_(q, k, torch.zeros(2, device=device), cos, sin)
    with pytest.raises(ValueError, match="caches"):
        fused.store_kv(
            k,
            v,
            torch.zeros(4, 2, 64, device=device),
            torch.zeros(4, 2, 64, device=device),
            torch.zeros(2, dtype=torch.long, device=device),
        )


def test_triton_available_only_with_cuda(device):
    assert fused.triton_available() == torch.cuda.is_available()


def test_without_triton_the_wrappers_raise_and_triton_is_unavailable(device, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "stallfree.engine.kernels._triton_fused", None)
    fused.triton_available.cache_clear()
    try:
        assert not fused.triton_available()
        with pytest.raises(RuntimeError, match="needs triton"):
            fused.silu_and_mul(torch.zeros(1, 8, device=device))
    finally:
        fused.triton_available.cache_clear()
