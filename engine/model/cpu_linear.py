"""Compact linear layers for the CPU: int4 / int8 weight-only quantization or bf16 weights, one GEMM.

A decode-heavy iteration multiplies a few rows by every weight of the model, so its time is the time to
read the weights from memory (fp32: 540 MB per iteration for the 135M default model); a prefill chunk of
hundreds of rows is compute-bound. `PackedLinear` keeps each weight once, compactly (int4 in groups of 32
along the input with a float32 scale and min each, as GGUF's Q4_1 blocks; int8 with one scale per output
channel; or bf16), and multiplies every row count with the same C++ kernel (`packed_linear` in
engine/kernels/cpu_kernels.cpp), which reads the weights once per call for all rows. int4 and int8 run as
llama.cpp's Q4_1 x Q8_1 does: each row of activations is quantized to int8 per group of 32 (a scale per
group), the code x activation products are summed exactly in int32 (AVX512-VNNI, or AVX2), and each
group's sum is scaled and added in float32 in a fixed order; bf16 weights multiply the bf16 activations in
float32, also in a fixed order. The result is rounded once to bf16.

NOTE: same request, same answer. A row's output is the same bits whether it runs alone, in a chunk of
hundreds, beside other requests or after a prefix-cache hit; the layers this replaces switched from a
weight-only kernel to oneDNN's bf16 matmul above a few rows, and the two round differently, so a repeated
request could get another answer (tests/engine/test_same_answer.py holds the engine to it).

Where the C++ kernels cannot be built (no compiler) the layer falls back to float32 torch matmuls on the
dequantized weights with unquantized activations, which make no promise about the order of the sums.

NOTE: for a GGUF whose linear weights are Q4_1 (the bundled model), int4 re-derives the file's own blocks:
llama.cpp sets a block's min to its smallest weight and its step to (max - min) / 15, so the dequantized
block's min and max give back the same min, step and 4-bit codes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stallfree.engine.config import QUANTIZATIONS

logger = logging.getLogger(__name__)

INT4_GROUP = 32
# The kernel's weight kinds (WeightKind in cpu_kernels.cpp).
KIND = {"int4": 0, "int8": 1, "none": 2}


def validate_quantization(quantization: str) -> None:
    """ValueError unless `quantization` names a mode this module packs."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def quantize_int4(w: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit codes of w (N, K) in groups of `group` along K.

    Returns (codes (N, K) int32 in 0..15, scale (N, K/group), zero (N, K/group)) with
    w ~= (codes - 8) * scale + zero, the layout torch's int4 kernels expect. Raises ValueError if K is not a
    multiple of the group.
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs input sizes divisible by {group}, got a ({n}, {k}) weight")
    wg = w.float().view(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (N, K/g)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = torch.clamp(torch.round((wg - lo[..., None]) / scale[..., None]), 0, 15)
    return codes.to(torch.int32).view(n, k), scale, lo + 8 * scale


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric 8-bit codes of w (N, K), one scale per output row: w ~= codes * scale[:, None]."""
    scale = (w.float().abs().amax(1) / 127).clamp(min=1e-10)  # (N,)
    codes = torch.clamp(torch.round(w.float() / scale[:, None]), -127, 127).to(torch.int8)
    return codes, scale


class PackedLinear(nn.Module):
    """y = x W^T (+ b) for x (T, K) -> (T, N) bf16, with W held as described in the module docstring."""

    def __init__(self, weight: Tensor, bias: Tensor | None, quantization: str = "none") -> None:
        super().__init__()
        validate_quantization(quantization)
        self.quantization = quantization
        self.out_features, self.in_features = n, k = weight.shape
        w = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.ops = _kernels()  # torch.ops.stallfree_cpu, or None
        none = torch.zeros(0)
        # the float32 grid is built only for the fallback (no kernels), see the module docstring
        fallback = self.ops is None
        if quantization == "int4":
            codes, scale, zero = quantize_int4(w)
            lo = zero - 8 * scale  # the block's min: w = code * scale + min
            grid = (
                (codes.view(n, -1, INT4_GROUP) * scale[..., None] + lo[..., None]).view(n, k)
                if fallback
                else None
            )
            # the kernel's zero groups up to K's multiple of 64
            pad = _padded(k) // INT4_GROUP - scale.shape[1]
            self.scale, self.minv = F.pad(scale, (0, pad)).contiguous(), F.pad(lo, (0, pad)).contiguous()
            codes_u8, bits = codes.to(torch.uint8), 4
        elif quantization == "int8":
            codes8, scale8 = quantize_int8(w)
            grid = codes8.float() * scale8[:, None] if fallback else None
            # stored as code + 128 (0..255): w = stored * scale + min, min = -128 * scale
            self.scale, self.minv = scale8.contiguous(), (-128.0 * scale8).contiguous()
            codes_u8, bits = (codes8.to(torch.int16) + 128).to(torch.uint8), 8
        else:
            grid, self.scale, self.minv = w.bfloat16().float() if fallback else None, none, none
        if fallback:
            self.packed, self.fallback = none, grid
        else:
            self.fallback = None
            self.packed = (
                self.ops.pack_weights(codes_u8, bits) if quantization != "none" else w.bfloat16().contiguous()
            )  # int4 / int8 codes in the kernel's lane order

    def dequantized(self) -> Tensor:
        """The weight the layer multiplies by, (N, K) float32."""
        if self.fallback is not None:
            return self.fallback
        n, k = self.out_features, self.in_features
        if self.quantization == "int4":
            groups = k // INT4_GROUP
            codes = self.ops.unpack_weights(self.packed, 4, k).float().view(n, groups, INT4_GROUP)
            return (codes * self.scale[:, :groups, None] + self.minv[:, :groups, None]).view(n, k)
        if self.quantization == "int8":
            return (self.ops.unpack_weights(self.packed, 8, k).float() - 128) * self.scale[:, None]
        return self.packed.float()

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(torch.bfloat16)  # (T, K)
        if self.ops is not None:
            return self.ops.packed_linear(
                x, KIND[self.quantization], self.packed, self.scale, self.minv, self.bias, self.out_features
            )
        assert self.fallback is not None
        return F.linear(x.float(), self.fallback, self.bias).bfloat16()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quantization={self.quantization}"


def _padded(k: int) -> int:
    """K rounded up to the kernel's multiple of 64 (QShape in cpu_kernels.cpp)."""
    return (k + 63) // 64 * 64


def _kernels():
    """torch.ops.stallfree_cpu when the C++ kernels build here, else None (logged once by available())."""
    from stallfree.engine.kernels import cpu_fused  # noqa: PLC0415 - the kernels import torch's extension loader

    return cpu_fused.load() if cpu_fused.available() else None


def pack_for_cpu(model: nn.Module, quantization: str = "none") -> nn.Module:
    """Replace the decoder's linear layers (and the LM head) of a bf16 model on the CPU by PackedLinear.

    The LM head is int8 in both quantized modes (the bundled model's embedding is Q8_0); the embedding
    table itself stays bf16 for lookups. Returns the model, changed in place.
    """
    validate_quantization(quantization)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            lin = getattr(owner, name)
            setattr(owner, name, PackedLinear(lin.weight, lin.bias, quantization))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.logits_proj = PackedLinear(head, None, "none" if quantization == "none" else "int8")
    from stallfree.engine.model.cpu_stack import CpuStack  # noqa: PLC0415 - it builds on this module

    model.cpu_stack = CpuStack.of(model)
    ops = model.logits_proj.ops
    logger.info(
        "linear layers packed for the CPU: %s weights, bf16 activations (kernels: %s)",
        quantization,
        ops.kernel_isa() if ops is not None else "none, plain torch ops",
    )
    return model
