"""Fused kernels for a Llama layer on CUDA: residual-add + RMSNorm, SiLU-and-mul, RoPE, KV-cache store.

Each kernel is a wrapper taking and returning torch tensors, a Triton kernel (in `_triton_fused`) and a
pure-torch `*_ref` function with the same semantics, which the tests hold the kernels to. Inputs may be
bfloat16, float16 or float32; the kernels compute in float32 and round once per stored value (except
add_rmsnorm, which rounds where the model's RMSNorm does).

The wrappers only allocate (`torch.empty`), check shapes and launch: no host synchronisation, no `.item()`,
so they can be captured in CUDA graphs. Launch each once before capture: the first launch compiles.

`triton_available()` says whether the model should take this path (CUDA and triton present). The wrappers
also run on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 was set before their first
launch (tests only: it is slow).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def triton_available() -> bool:
    """True when triton imports and CUDA is available; False on CPU, where the model keeps torch ops."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _kernels() -> ModuleType:
    """The module of @triton.jit kernels, imported (and so decorated) at the first launch."""
    try:
        return importlib.import_module("stallfree.engine.kernels._triton_fused")
    except ImportError as e:
        raise RuntimeError(
            "stallfree.engine.kernels.fused needs triton (it ships with CUDA builds of torch); "
            "use the *_ref functions or the model's torch ops without it"
        ) from e


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


# --- residual add + RMSNorm ------------------------------------------------------------------------------


def _row_warps(block: int) -> int:
    """Warps for a program that holds `block` elements of a row."""
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def add_rmsnorm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Reference for `add_rmsnorm`: the sum rounded to x.dtype, then RMSNorm's rounding order."""
    new_residual = x if residual is None else (x.float() + residual.float()).to(x.dtype)  # (T, C)
    r = new_residual.float()
    normed = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), new_residual


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Residual add fused with RMSNorm: returns (out, new_residual), both (T, C) in x.dtype.

    x, residual: (T, C); weight: (C,), normally in x.dtype. new_residual = x + residual (summed in fp32,
    stored in x.dtype), or x itself (no copy) when residual is None. out = weight * normalise(new_residual),
    rounded as the model's RMSNorm rounds it: normalise in fp32, round to x.dtype, multiply by the weight,
    round to x.dtype. One program per row; C up to 65536 (tested to 8192).
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"add_rmsnorm needs x (T, C) and weight (C,), got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    _check_float("x", x)
    _check_float("weight", weight)
    if residual is not None:
        _check_float("residual", residual)
    T, C = x.shape
    block = _next_power_of_2(C)
    if block > 65536:
        raise ValueError(f"add_rmsnorm keeps a row in registers: C must be at most 65536, got {C}")
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty((T, C), dtype=x.dtype, device=x.device)
    if T == 0:
        return out, new_residual
    res = x if residual is None else residual  # unused by the kernel without a residual
    _kernels().add_rmsnorm_kernel[(T,)](
        x, res, weight, out, new_residual,
        x.stride(0), res.stride(0), out.stride(0), new_residual.stride(0),
        C, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
    )  # fmt: skip
    return out, new_residual


# --- SiLU and multiply -----------------------------------------------------------------------------------


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """Reference for `silu_and_mul`: silu(gate) * up in fp32, rounded once to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)  # (T, I) each
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's activation: x (T, 2I) = gate | up, returns silu(gate) * up (T, I), one rounding."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x (T, 2I), got {tuple(x.shape)}")
    _check_float("x", x)
    T, inter = x.shape[0], x.shape[1] // 2  # inter = I, the intermediate size
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(1024, _next_power_of_2(inter))
    grid = (T, (inter + block - 1) // block)
    _kernels().silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


# --- rotary embedding ------------------------------------------------------------------------------------


def rope_ref(q: Tensor, k: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor) -> None:
    """Reference for `rope_`: rotates q and k in place, computing in fp32 and rounding once.

    (The model's `apply_rotary` instead computes in x.dtype; the two agree within a few roundings.)
    """
    cos = cos_cache[positions].float().unsqueeze(1)  # (T, 1, hd/2)
    sin = sin_cache[positions].float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)  # (T, n, hd/2) each
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rope_(q: Tensor, k: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor) -> None:
    """Rotary embedding, in place on q (T, nh, hd) and k (T, nkv, hd), in one launch.

    HF "rotate_half" layout: the pair (x[i], x[i + hd/2]) becomes (x1 cos - x2 sin, x2 cos + x1 sin), with
    cos/sin = cos_cache/sin_cache[position, i], caches (max_pos, hd/2) float32. positions (T,) are absolute
    and must be < max_pos (not checked: that would need a sync). q and k may be strided views of one fused
    qkv output (T, nh*hd + 2*nkv*hd): strides are read from the tensors; only the last must be 1.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rope_ needs q (T, nh, hd) and k (T, nkv, hd), got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    T, nh, hd = q.shape
    nkv = k.shape[1]
    if hd % 2 or cos_cache.shape[1:] != (hd // 2,) or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches must be (max_pos, {hd // 2}), got {tuple(cos_cache.shape)}")
    if cos_cache.stride() != sin_cache.stride() or cos_cache.stride(-1) != 1:
        raise ValueError("cos_cache and sin_cache must have the same strides, contiguous in the last dim")
    if positions.shape != (T,) or positions.is_floating_point():
        raise ValueError(
            f"positions must be integer (T,) = ({T},), got {positions.dtype} {tuple(positions.shape)}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    _check_float("q", q)
    _check_float("k", k)
    if T == 0:
        return
    block = _next_power_of_2(hd // 2)
    _kernels().rope_kernel[(T, nh + nkv)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        nh,
        HALF=hd // 2, BLOCK=block, num_warps=1 if block <= 64 else 2,
    )  # fmt: skip


# --- KV-cache store --------------------------------------------------------------------------------------


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Reference for `store_kv` (this one synchronises: it selects the non-negative slots on the host)."""
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k and v (T, nkv, hd) into k_cache / v_cache (num_slots, nkv, hd) at slot_mapping (T,).

    The caches are the flat view of paged caches (num_blocks, block_size, nkv, hd), so slot = block *
    block_size + offset. Rows whose slot is negative (padding rows of a CUDA graph) are skipped; slots must
    be < num_slots (not checked: that would need a sync). Values are cast to the cache dtype. k and v may be
    strided views of a fused qkv output; one launch writes both.
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"store_kv needs k and v (T, nkv, hd) of one shape, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    T, nkv, hd = k.shape
    if k_cache.dim() != 3 or k_cache.shape[1:] != (nkv, hd) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches must be (num_slots, {nkv}, {hd}), got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have the same strides, contiguous in the last dim")
    if slot_mapping.shape != (T,) or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be integer (T,) = ({T},), got {tuple(slot_mapping.shape)}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
    if T == 0:
        return
    block = _next_power_of_2(hd)
    _kernels().store_kv_kernel[(T, nkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=hd, BLOCK=block, num_warps=1 if block <= 128 else 2,
    )  # fmt: skip
