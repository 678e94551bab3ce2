"""Compact linear layers for the CPU: bf16 weights through oneDNN, int4 / int8 weight-only quantization.

A decode-heavy iteration multiplies a few rows by every weight of the model, so its time is the time to
read the weights from memory (fp32: 540 MB per iteration for the 135M default model); a prefill chunk of
hundreds of rows is compute-bound. One `PackedLinear` therefore keeps the weight in the two forms that
suit each case and picks by the number of rows T:

- T <= small_rows: the weight-only kernels, which read 4 or 8 bits per weight and multiply bf16 rows
  (`torch.ops.aten._weight_int4pack_mm_for_cpu`, groups of 32 along the input with a scale and a zero
  each, as GGUF's Q4_1 blocks; `torch.ops.aten._weight_int8pack_mm`, one scale per output channel).
- otherwise: oneDNN's bf16 matmul on a prepacked weight (AMX / AVX512-BF16 where the CPU has them). In the
  int4 / int8 modes that weight is the *dequantized* quantized weight, so both paths compute with the same
  weights up to bf16 rounding, and a chunked prefill sees the model a one-shot prefill sees.

Activations are bf16 in every mode here (the weight-only kernels take bf16 rows); the caller loads the
model in bf16. The fp32 reference never comes through this module.

NOTE: for a GGUF whose linear weights are Q4_1 (the bundled model), int4 re-derives the file's own blocks:
llama.cpp sets a block's min to its smallest weight and its step to (max - min) / 15, so the dequantized
block's min and max give back the same min, step and 4-bit codes (scales and zeros rounded to bf16).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stallfree.engine.config import QUANTIZATIONS

logger = logging.getLogger(__name__)

INT4_GROUP = 32
# Rows up to which the weight-only kernel beats oneDNN's bf16 matmul on the SmolLM2 shapes (one thread,
# docs/engine.md): int4 costs ~3 ms per row over all layers against a flat ~21 ms for bf16; int8 ~16 ms at 1 row.
SMALL_ROWS = {"int4": 6, "int8": 2, "none": 0}


def validate_quantization(quantization: str) -> None:
    """ValueError unless `quantization` names a mode this module packs."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def onednn_bf16() -> bool:
    """Whether oneDNN's bf16 matmul is available on this CPU (else plain F.linear in bf16 is used)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


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
        self.small_rows = SMALL_ROWS[quantization]
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        self.int4: tuple[Tensor, Tensor] | None = None  # (packed codes, (K/g, N, 2) bf16 scale and zero)
        self.int8: tuple[Tensor, Tensor] | None = None  # ((N, K) int8 codes, (N,) bf16 scales)
        if quantization == "int4":
            codes, scale, zero = quantize_int4(w)
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()  # (K/g, N, 2)
            self.int4 = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), sz)
            # The bf16 path's weight: what the int4 kernel computes with (its scale and zero are bf16).
            s, z = sz.float().transpose(0, 1).unbind(-1)  # (N, K/g) each
            w = ((codes.float().view(*s.shape, -1) - 8) * s[..., None] + z[..., None]).view_as(w)
        elif quantization == "int8":
            codes8, scale8 = quantize_int8(w)
            self.int8 = (codes8, scale8.bfloat16())
            w = codes8.float() * scale8.bfloat16().float()[:, None]
        self.bias = None if bias is None else bias.detach().bfloat16()
        self.onednn = onednn_bf16()
        wb = w.bfloat16()
        self.weight_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb, None) if self.onednn else wb

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(torch.bfloat16)  # (T, K)
        if x.shape[0] <= self.small_rows:
            if self.int4 is not None:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4[0], INT4_GROUP, self.int4[1])
            else:
                assert self.int8 is not None  # small_rows > 0 only in the quantized modes
                out = torch.ops.aten._weight_int8pack_mm(x, *self.int8)
            return out if self.bias is None else out + self.bias
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_bf16, self.bias, "none", [], "")
        return F.linear(x, self.weight_bf16, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quantization={self.quantization}"


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
    logger.info("linear layers packed for the CPU: %s weights, bf16 activations", quantization)
    return model
