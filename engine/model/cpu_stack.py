"""A CPU-packed Llama decoder's layers in one C++ call (cpu_kernels.cpp `decoder_stack`).

The fused Python path calls about eleven kernels per layer, each through Python (module calls, views,
the dispatcher): on a 2-core box that glue was a third of a batch-1 decode step. `decoder_stack` makes the
same kernel calls, with the same arguments in the same order, from C++, so its output is the Python path's
bit for bit (tests/engine/test_cpu_stack.py holds that) and only the glue goes.

It runs when the model was packed for the CPU (`pack_for_cpu`: every linear a PackedLinear on the C++
kernels), has no per-head q/k norms (Qwen3 keeps the Python path), and the runner's attention backend offers
its caches and every row's table as `PagedRows` (AttentionBackend.paged_rows: the cpu backend's every-row
paged kernel), which the runner hands to the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stallfree.engine.model.cpu_linear import KIND, PackedLinear


@dataclass(frozen=True, slots=True)
class PagedRows:
    """What the cpu backend's attention reads, for a stack that calls the kernels itself: every row (decodes
    first, then chunk tokens) by its request's block table and key count (store, then attend)."""

    k_caches: list[Tensor]  # per layer (num_blocks, block_size, nkv, hd)
    v_caches: list[Tensor]
    slot_mapping: Tensor  # (T,) int64, negative: not stored
    block_tables: Tensor  # (T, pages) int32
    seq_lens: Tensor  # (T,) int32: keys each row sees, itself included
    scale: float


class CpuStack:
    """The layers' tensors in the order `decoder_stack` takes them; call with embedded tokens."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        layers = model.model.layers
        linears: list[PackedLinear] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        self.ops = linears[0].ops
        self.weights = [lin.packed for lin in linears]
        self.scales = [lin.scale for lin in linears]
        self.mins = [lin.minv for lin in linears]
        self.biases = [lin.bias for lin in linears]
        self.kinds = [KIND[lin.quantization] for lin in linears]
        self.outs = [lin.out_features for lin in linears]
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._norm_weights = [n.weight for n in [*norms, model.model.norm]]
        self._norms: dict[torch.dtype, list[Tensor]] = {}
        self.eps = float(model.model.norm.eps)
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.rotary = model.rotary

    @staticmethod
    def of(model: nn.Module) -> CpuStack | None:
        """The stack for a packed Llama model, or None where the Python path must run (see the module doc)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or getattr(model.config, "qk_norm", False):
            return None
        for layer in layers:
            linears = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            if not all(isinstance(lin, PackedLinear) and lin.ops is not None for lin in linears):
                return None
        return CpuStack(model)

    def norms(self, dtype: torch.dtype) -> list[Tensor]:
        """The norm weights in the activations' dtype (the fused path casts them per call)."""
        if dtype not in self._norms:
            self._norms[dtype] = [w.detach().to(dtype) for w in self._norm_weights]
        return self._norms[dtype]

    def __call__(self, x: Tensor, positions: Tensor, rows: PagedRows) -> Tensor:
        """x (T, C) embedded tokens, positions (T,) int64 absolute -> final-norm hidden states (T, C)."""
        return self.ops.decoder_stack(
            x, positions, self.rotary.cos_cache, self.rotary.sin_cache, self.norms(x.dtype), self.eps,
            self.weights, self.scales, self.mins, self.biases, self.kinds, self.outs,
            rows.k_caches, rows.v_caches, rows.slot_mapping, rows.block_tables, rows.seq_lens,
            self.num_heads, self.num_kv_heads, rows.scale,
        )  # fmt: skip
