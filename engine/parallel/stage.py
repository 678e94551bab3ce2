"""One pipeline stage of a (possibly tensor-parallel) Llama model, and how layers are split into stages."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import AttentionFn, LlamaForCausalLM, StageParts
from stallfree.engine.parallel.layers import Collective, NoCollective, gather_logits, shard_model, split_range


def stage_layers(num_layers: int, pp_size: int, stage: int) -> tuple[int, int]:
    """[first, last) decoder layers of pipeline stage `stage` (contiguous, as even as possible)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    return split_range(num_layers, pp_size, stage)


class StageModel(nn.Module):
    """Layers [first, last) of the model on one rank; the first stage embeds, the last one norms and
    projects logits (gathered over the tensor-parallel group)."""

    def __init__(self, model: LlamaForCausalLM, pp_size: int, stage: int, comm: Collective) -> None:
        super().__init__()
        cfg = model.config
        self.config = cfg
        self.first, self.last = stage == 0, stage == pp_size - 1
        lo, hi = stage_layers(cfg.num_layers, pp_size, stage)
        self.layer_range = (lo, hi)
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = (
                i  # NOTE: index into this rank's KV cache, which holds only these layers
            )
        self.embed_tokens = model.model.embed_tokens if self.first else None
        self.norm = model.model.norm if self.last else None
        self.full = model  # compute_logits reads the (sharded) embedding / lm_head through it
        self.rotary = model.rotary
        self.comm = comm

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self, x: Tensor, positions: Tensor, attn: AttentionFn, kernels: ModuleType | None = None
    ) -> Tensor:
        """x: (T,) int64 ids on the first stage, else (T, C) hidden states from the previous stage.
        kernels: the attention backend's fused elementwise ops, or None for plain torch ops."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (T, C)
        if kernels is not None:
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_fused(x, residual, positions, self.rotary, attn, kernels)
            if self.norm is None:
                return x + residual  # NOTE: the next stage takes the residual stream whole
            return kernels.add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]
        cos, sin = self.rotary(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x if self.norm is None else self.norm(x)

    def parts(self) -> StageParts:
        return StageParts(self.embed_tokens, self.layers, self.norm, self.rotary)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return gather_logits(self.full, hidden, self.comm)


def build_stage(
    config: LlamaConfig,
    state: dict[str, Tensor],
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int,
    stage: int,
    comm: Collective | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StageModel:
    """This rank's share of the model, from the full model's state dict (no random initialisation).

    Tensors that already match dtype/device are used as they are (shared memory from the leader stays
    shared until the slicing copies this rank's part).
    """
    from stallfree.engine.model.llama import RotaryEmbedding

    comm = comm or NoCollective()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    lo, hi = stage_layers(config.num_layers, pp_size, stage)
    keep = {}
    for name, t in state.items():
        if name.startswith("model.layers."):
            idx = int(name.split(".")[2])
            if not lo <= idx < hi:
                continue
        keep[name] = t.to(device=device, dtype=dtype)
    missing, _ = model.load_state_dict(keep, strict=False, assign=True)
    outside = [m for m in missing if m.startswith("model.layers.") and not lo <= int(m.split(".")[2]) < hi]
    if set(missing) - set(outside):
        raise ValueError(f"the weights lack {sorted(set(missing) - set(outside))[:5]}")
    model.rotary = RotaryEmbedding(config, device=device)
    if tp_size > 1:
        layers = model.model.layers
        model.model.layers = nn.ModuleList(layers[lo:hi])  # shard only what this stage keeps
        shard_model(model, tp_size, tp_rank, comm)
        model.model.layers = nn.ModuleList(list(layers[:lo]) + list(model.model.layers) + list(layers[hi:]))
    return StageModel(model.eval(), pp_size, stage, comm)
