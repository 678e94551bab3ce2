"""Sizing engine pods from the model: GPU count and host memory from the weight bytes and KV cache.

Pure functions over the model's shape (read from the hub by stallfree.operator.model_source). The rules
(docs/operator.md, "Sizing"):

- GPUs per replica (parallelism.tensor, when neither it nor resources.gpusPerPod is set): the fewest, a
  power of two up to resources.gpusPerNode, whose memory (resources.gpuMemory each, 90% usable, less 1 GiB
  each for the CUDA context and activations) holds the weights plus the KV cache of one maxModelLen
  sequence: the least an engine needs to serve its longest request. What is left is KV cache for
  concurrency; status.model.kvBytesFull says what maxNumSeqs sequences of maxModelLen tokens would take.
- Host memory (resources.memory, when unset): the loader streams tensor by tensor, so a GPU pod needs far
  less than the weights: 6 GiB + 2 GiB per GPU (CUDA contexts, pinned buffers, tokenizer, one tensor in
  flight). A CPU pod (gpusPerPod 0) holds the weights and the KV cache in RAM: weights + one maxModelLen
  sequence's KV + 2 GiB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 1 << 30
GPU_USABLE = 0.9  # share of a GPU's memory the engine plans with
GPU_RESERVED = 1 * GIB  # per GPU: CUDA context, activations, graphs
HOST_BASE, HOST_PER_GPU, CPU_HEADROOM = 6 * GIB, 2 * GIB, 2 * GIB
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_SUFFIX.update({k + "i": 1 << (10 * i) for i, k in enumerate("KMGTPE", start=1)})


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizing needs from a checkpoint (config.json + the safetensors files' sizes)."""

    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    context_length: int  # max_position_embeddings

    @classmethod
    def from_config(cls, config: dict, weight_bytes: int) -> ModelShape:
        """From a Hugging Face config.json; raises ValueError naming a missing key."""
        text = config.get("text_config") or config  # multimodal wrappers keep the LM's config inside
        try:
            layers = int(text["num_hidden_layers"])
            heads = int(text["num_attention_heads"])
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]}: cannot size the KV cache") from e
        return cls(
            weight_bytes=weight_bytes,
            layers=layers,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            context_length=int(text.get("max_position_embeddings") or 4096),
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if dtype == "float32" else 2)  # K and V


@dataclass(frozen=True, slots=True)
class Sizing:
    """What the operator derived; gpus/memory are None where the spec's own value stands."""

    shape: ModelShape
    max_model_len: int
    kv_bytes_per_token: int
    kv_bytes_full: int  # maxNumSeqs sequences of max_model_len tokens
    gpus: int | None  # parallelism.tensor to use, None = the spec's
    memory: str | None  # resources.memory to use, None = the spec's


def parse_quantity(q: str | int) -> int:
    """A Kubernetes quantity (8Gi, 80G, 1.5Ti, 1024) in bytes."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i?)?", str(q).strip())
    if m is None:
        raise ValueError(f"{q!r} is not a memory quantity like 8Gi")
    return int(float(m[1]) * _SUFFIX[m[2] or ""])


def gib(n_bytes: int) -> str:
    """Bytes rounded up to whole GiB, as a quantity."""
    return f"{max(1, math.ceil(n_bytes / GIB))}Gi"


def human_size(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.1f}Gi"


def gpus_needed(need_bytes: int, gpu_memory: int, gpus_per_node: int) -> int:
    """The fewest GPUs (a power of two, at most gpus_per_node) that hold need_bytes; gpus_per_node when none
    does (the pods then fail to load, which the engine reports)."""
    n = 1
    while n < gpus_per_node and need_bytes > n * (gpu_memory * GPU_USABLE - GPU_RESERVED):
        n *= 2
    return min(n, gpus_per_node)


def size(
    shape: ModelShape,
    *,
    dtype: str,
    max_model_len: int | None,
    max_num_seqs: int,
    gpu_memory: str | int,
    gpus_per_node: int,
    cpu_only: bool,
    size_gpus: bool,
    size_memory: bool,
    fixed_gpus: int,
    pipeline: int = 1,
) -> Sizing:
    """Apply the rules in the module docstring. size_gpus / size_memory say which spec fields were left
    unset; fixed_gpus is the GPU count per pod when the GPUs are not sized. With pipeline stages the
    weights and KV split over them, and the tensor size is chosen per stage."""
    length = max_model_len or shape.context_length
    per_token = shape.kv_bytes_per_token(dtype)
    one_sequence = per_token * length
    gpus, per_pod = None, fixed_gpus
    if size_gpus and not cpu_only:
        need = math.ceil((shape.weight_bytes + one_sequence) / pipeline)
        tensor = gpus_needed(need, parse_quantity(gpu_memory), gpus_per_node)
        total = tensor * pipeline
        if total <= gpus_per_node or total % gpus_per_node == 0:  # a layout the spec allows
            gpus, per_pod = tensor, min(total, gpus_per_node)
    memory = None
    if size_memory:
        if cpu_only:
            memory = gib(shape.weight_bytes + one_sequence + CPU_HEADROOM)
        else:
            memory = gib(HOST_BASE + HOST_PER_GPU * per_pod)
    return Sizing(shape, length, per_token, per_token * length * max_num_seqs, gpus, memory)
