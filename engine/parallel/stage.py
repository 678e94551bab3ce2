"""One pipeline stage of a (possibly tensor-parallel) Llama model, and how layers are split into stages.

A stage is the model class itself (LlamaForCausalLM, cut down by `keep_layers`): the same forward, the same
CUDA graphs, with first-stage and last-stage roles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.parallel.layers import Collective, NoCollective, shard_model, split_range


def stage_layers(num_layers: int, pp_size: int, stage: int) -> tuple[int, int]:
    """[first, last) decoder layers of pipeline stage `stage` (contiguous, as even as possible)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    return split_range(num_layers, pp_size, stage)


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
) -> LlamaForCausalLM:
    """This rank's share of the model, from the full model's state dict (no random initialisation): the
    model class with layers [first, last) of stage `stage`, sharded for tensor rank `tp_rank` of `tp_size`.

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
    model.keep_layers(lo, hi, first_stage=stage == 0, last_stage=stage == pp_size - 1)
    if tp_size > 1:
        shard_model(model, tp_size, tp_rank, comm)  # only what this stage keeps
    return model.eval()
