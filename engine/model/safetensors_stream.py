"""Stream a Hugging Face checkpoint's safetensors into the model, tensor by tensor, chunk by chunk.

Each checkpoint tensor is copied straight into its place in a parameter that already lives on the target
device in the target dtype (`copy_` converts on the way): q/k/v land in their rows of `qkv_proj`, gate/up
in theirs of `gate_up_proj`, so nothing is concatenated on the host and no second copy of the model exists.

NOTE (host memory): `safe_open` memory-maps the whole shard, and every page a read touches counts in the
process's RSS until the map is closed: reading a 5 GB shard under one `safe_open` would leave 5 GB
resident. So each chunk of rows (CHUNK_BYTES) is read under its own `safe_open`, whose close unmaps it
(the pages stay in the kernel's page cache, outside the process). Besides the parameters themselves the
host then holds about one chunk of the checkpoint, whatever the size of a shard or a tensor.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM, RotaryEmbedding

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
_ITEM_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}  # others: 1
_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    """Where one tensor of a safetensors checkpoint is, from the shard headers (no data read)."""

    name: str
    shard: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES.get(self.dtype, 1)


@dataclass(frozen=True, slots=True)
class Target:
    """Rows [start, stop) of parameter `param` (all of it for an unfused tensor: stop = None)."""

    param: str
    start: int = 0
    stop: int | None = None


class ParamSink(Protocol):
    """Where streamed parameters go: `allocate` gives a parameter's empty destination (target device and
    dtype), `complete` receives it once every checkpoint tensor that makes it up has been copied in."""

    def allocate(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...

    def complete(self, name: str, tensor: torch.Tensor) -> None: ...


def list_tensors(folder: Path) -> list[CheckpointTensor]:
    """Every tensor of every *.safetensors shard in `folder`, from the headers. FileNotFoundError without
    shards, ValueError for a tensor named in two shards."""
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights (.bin checkpoints are not supported)")
    found: dict[str, CheckpointTensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                part = f.get_slice(name)
                if name in found:
                    raise ValueError(f"tensor {name} is in both {found[name].shard.name} and {shard.name}")
                found[name] = CheckpointTensor(name, shard, tuple(part.get_shape()), part.get_dtype())
    return list(found.values())


def read_into(t: CheckpointTensor, dst: torch.Tensor, chunk_bytes: int | None = None) -> None:
    """Copy checkpoint tensor `t` into `dst` (same shape, any device and dtype), a chunk of rows at a time
    (default CHUNK_BYTES), each under its own safe_open so that no more than a chunk of the shard stays
    mapped (module NOTE)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if tuple(dst.shape) != t.shape:
        raise ValueError(f"{t.name}: checkpoint shape {t.shape} != destination shape {tuple(dst.shape)}")
    if not t.shape:  # a scalar
        with safe_open(str(t.shard), framework="pt") as f:
            dst.copy_(f.get_tensor(t.name))
        return
    rows = t.shape[0]
    step = max(1, chunk_bytes // max(1, t.nbytes // max(1, rows)))
    for start in range(0, rows, step):
        with safe_open(str(t.shard), framework="pt") as f:
            part = f.get_slice(t.name)[start : start + step]  # a view of the mapped file
            dst[start : start + step].copy_(part)
            del part  # NOTE: before the close, so the map has no user left


def fused_part(name: str) -> tuple[str, int | None]:
    """(parameter, part) for HF checkpoint key `name`: q/k/v are parts 0/1/2 of qkv_proj, gate/up parts
    0/1 of gate_up_proj; any other key is the whole parameter of its own name (part None)."""
    m = _FUSED.match(name)
    if m is None:
        return name, None
    prefix, _, qkv, gate_up, kind = m.groups()
    if qkv is not None:
        return f"{prefix}self_attn.qkv_proj.{kind}", "qkv".index(qkv)
    return f"{prefix}mlp.gate_up_proj.{kind}", ("gate", "up").index(gate_up)


def plan(
    config: LlamaConfig, tensors: list[CheckpointTensor], params: Mapping[str, tuple[int, ...]]
) -> list[tuple[CheckpointTensor, Target]]:
    """Each checkpoint tensor with its destination rows, checked before any data is read: ValueError names
    the unexpected, missing and mis-shaped tensors. Skips derived RoPE buffers and a tied LM head."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    part_rows = {
        "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "gate_up_proj": [(0, inter), (inter, 2 * inter)],
    }
    out: list[tuple[CheckpointTensor, Target]] = []
    covered: dict[str, int] = {}
    unexpected: list[str] = []
    for t in tensors:
        if t.name.endswith("rotary_emb.inv_freq") or (
            t.name == "lm_head.weight" and config.tie_word_embeddings
        ):
            continue
        param, part = fused_part(t.name)
        if param not in params:
            unexpected.append(t.name)
            continue
        shape = params[param]
        if part is None:
            target, want = Target(param), shape
        else:
            start, stop = part_rows[param.split(".")[-2]][part]
            target, want = Target(param, start, stop), (stop - start, *shape[1:])
        if t.shape != want:
            raise ValueError(f"{t.name}: checkpoint shape {t.shape} != shape {want} from the config")
        covered[param] = covered.get(param, 0) + (want[0] if want else 1)
        out.append((t, target))
    missing = sorted(p for p, shape in params.items() if covered.get(p, 0) != (shape[0] if shape else 1))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the config: missing {missing[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return out


def stream_checkpoint(
    config: LlamaConfig, folder: Path, params: Mapping[str, tuple[int, ...]], sink: ParamSink
) -> int:
    """Copy every tensor of the checkpoint in `folder` into the parameters `params` (name -> shape) that
    `sink` allocates, handing each to `sink.complete` as soon as it is whole. Returns the bytes read."""
    steps = plan(config, list_tensors(folder), params)
    parts_left: dict[str, int] = {}
    for _, target in steps:
        parts_left[target.param] = parts_left.get(target.param, 0) + 1
    open_params: dict[str, torch.Tensor] = {}
    nbytes = 0
    for t, target in steps:
        dst = open_params.get(target.param)
        if dst is None:
            dst = open_params[target.param] = sink.allocate(target.param, params[target.param])
        read_into(t, dst if target.stop is None else dst[target.start : target.stop])
        nbytes += t.nbytes
        parts_left[target.param] -= 1
        if parts_left[target.param] == 0:
            sink.complete(target.param, open_params.pop(target.param))
    return nbytes


class _ModelSink:
    """Parameters allocated on the target device in the target dtype, collected for `load_state_dict`."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype, self.device = dtype, device
        self.params: dict[str, torch.Tensor] = {}

    def allocate(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def complete(self, name: str, tensor: torch.Tensor) -> None:
        self.params[name] = tensor


@torch.no_grad()
def load_streamed(
    config: LlamaConfig, folder: Path, dtype: torch.dtype, device: torch.device | str
) -> LlamaForCausalLM:
    """The model of `config` with the weights of the safetensors in `folder`, streamed to `device`.

    Raises FileNotFoundError without shards, ValueError when names or shapes do not match the config."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sink = _ModelSink(dtype, device)
    nbytes = stream_checkpoint(config, folder, shapes, sink)
    model.load_state_dict(sink.params, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config, device=device)  # its buffers are derived, not loaded
    logger.debug("streamed %.1f MB of safetensors from %s", nbytes / 1e6, folder)
    return model.eval()
