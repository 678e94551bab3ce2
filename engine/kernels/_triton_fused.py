"""The Triton kernels behind `stallfree.engine.kernels.fused`; call the wrappers there, not these.

NOTE: this module is imported by fused.py at the first kernel launch, not when fused.py is imported: that is
when `@triton.jit` reads TRITON_INTERPRET, so a process that imported the model before setting it (CPU
tests) still gets the interpreter, and fused.py imports on machines without triton.

Every kernel loads in the tensors' dtype, computes in float32 and rounds once per stored value (except
where a rounding is part of the semantics, see add_rmsnorm_kernel). Row indices are widened to int64 before
they are multiplied by strides: T * row_stride and slot * slot_stride can pass 2**31.
"""

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_kernel(
    x_ptr,  # (T, C)
    residual_ptr,  # (T, C), unused without HAS_RESIDUAL
    weight_ptr,  # (C,)
    out_ptr,  # (T, C)
    new_residual_ptr,  # (T, C), unused without HAS_RESIDUAL
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    new_residual_row_stride,
    C,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: r = x + residual; out = weight * normalise(r), as RMSNorm rounds it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    r = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # NOTE: the norm reads the sum as stored (rounded to the activation dtype), as the torch path does.
        r = (r + res.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_row_stride + cols, r, mask=mask)
        r = r.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(r * r, axis=0) / C + eps)
    # RMSNorm's rounding order: normalise in fp32, round to the dtype, multiply by the weight, round again.
    normed = (r * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # (T, 2I): gate | up
    out_ptr,  # (T, I)
    x_row_stride,
    out_row_stride,
    inter,  # I, the intermediate size
    BLOCK: tl.constexpr,
):
    """Program (row, block): out = silu(gate) * up over BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr,  # (T, nh, hd)
    k_ptr,  # (T, nkv, hd)
    positions_ptr,  # (T,)
    cos_ptr,  # (max_pos, hd/2) float32
    sin_ptr,  # (max_pos, hd/2) float32
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cache_row_stride,
    num_q_heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token, head), heads 0..nh-1 of q then nkv of k: rotate the pairs (i, i + hd/2) in place."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + token * q_token_stride + head * q_head_stride
    else:
        base = k_ptr + token * k_token_stride + (head - num_q_heads) * k_head_stride
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(positions_ptr + token).to(tl.int64)  # absolute position of this token
    cos = tl.load(cos_ptr + pos * cache_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cache_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
    tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    k_ptr,  # (T, nkv, hd)
    v_ptr,  # (T, nkv, hd)
    k_cache_ptr,  # (num_slots, nkv, hd)
    v_cache_ptr,  # (num_slots, nkv, hd)
    slot_mapping_ptr,  # (T,)
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_slot_stride,
    cache_head_stride,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token, kv head): copy k and v into the cache at the token's slot, unless it is negative."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # A negative slot marks a padding row (CUDA graphs): masked off, nothing is read or written.
    # NOTE: not `(offs < HEAD_DIM) & (slot >= 0)`: Triton 3.9's interpreter turns a vector & scalar of bools
    # into int32 and then rejects it as a mask.
    mask = offs < tl.where(slot >= 0, HEAD_DIM, 0)
    k = tl.load(k_ptr + token * k_token_stride + head * k_head_stride + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * v_token_stride + head * v_head_stride + offs, mask=mask, other=0.0)
    dst = slot * cache_slot_stride + head * cache_head_stride + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
