"""The one `auto` resolver: the device, dtype and weight quantization an engine runs with.

`LLM()`, `stallfree serve` (and `stallfree profile`) and the engine over T x P worker ranks all resolve
through `resolve_placement`, so the offline API and the server give the same answer for the same model and
prompt by default. The steps, in order:

1. device auto: cuda when a CUDA device is available, else cpu.
2. A model already loaded (LLM(loaded_model=...)): dtype and quantization auto follow its weights.
3. CUDA: dtype auto is bfloat16 (float16 where the GPU has no bf16); no weight-only quantization.
4. CPU, worker ranks (T x P > 1): dtype auto is float32; no weight-only quantization (its packed layers
   are not sharded).
5. CPU, one process: dtype auto is bfloat16, and quantization auto int4 with bf16 (none with another
   dtype): the fastest configuration whose greedy agreement with fp32 is >= 90% (docs/engine.md). float32
   stays the exact reference, one flag away.

The attention backend's `auto` is the registry's (stallfree.engine.attention.registry), given this device and
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stallfree.engine.config import DTYPES, QUANTIZATIONS

if TYPE_CHECKING:
    from stallfree.engine.model.loader import LoadedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Placement:
    """What `auto` stood for: the device, the dtype of weights, activations and KV cache, and the CPU's
    weight-only quantization of the linear layers (none, int8 or int4)."""

    device: torch.device
    dtype: torch.dtype
    quantization: str


def resolve_placement(
    device: str = "auto",
    dtype: str = "auto",
    quantization: str = "auto",
    *,
    world_size: int = 1,
    loaded: LoadedModel | None = None,
) -> Placement:
    """Resolve the `auto`s of device, dtype and quantization (the module docstring's rules).

    Raises ValueError, with what to do instead, for a name it does not know and for quantization where it
    cannot run (off the CPU, with worker ranks, or with activations other than bf16)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization not in ("auto", *QUANTIZATIONS):
        raise ValueError(
            f"quantization must be one of auto, {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    dev = resolve_device(device)
    if loaded is not None:
        return _follow_the_model(dev, dtype, quantization, loaded)
    if dev.type != "cpu":
        return _on_gpu(dev, dtype, quantization)
    if world_size > 1:
        return _on_cpu_ranks(dev, dtype, quantization)
    return _on_one_cpu(dev, dtype, quantization)


def resolve_device(name: str) -> torch.device:
    """auto: cuda when a CUDA device is available, else cpu; otherwise the device named."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from e


def _follow_the_model(dev: torch.device, dtype: str, quantization: str, loaded: LoadedModel) -> Placement:
    """A loaded model: auto is what its weights are (they are not loaded again)."""
    weights = next(loaded.model.parameters()).dtype
    packed = _packed_quantization(loaded.model)
    return Placement(
        dev,
        weights if dtype == "auto" else _DTYPES[dtype],
        packed if quantization == "auto" else quantization,
    )


def _on_gpu(dev: torch.device, dtype: str, quantization: str) -> Placement:
    if quantization not in ("auto", "none"):
        raise ValueError(f"quantization {quantization} runs on the CPU only: use quantization none (or auto)")
    if dtype != "auto":
        return Placement(dev, _DTYPES[dtype], "none")
    bf16 = dev.type != "cuda" or torch.cuda.is_bf16_supported()
    return Placement(dev, torch.bfloat16 if bf16 else torch.float16, "none")


def _on_cpu_ranks(dev: torch.device, dtype: str, quantization: str) -> Placement:
    if quantization not in ("auto", "none"):
        raise ValueError(
            f"quantization {quantization} runs in the single-process CPU engine only (world size 1)"
        )
    return Placement(dev, torch.float32 if dtype == "auto" else _DTYPES[dtype], "none")


def _on_one_cpu(dev: torch.device, dtype: str, quantization: str) -> Placement:
    dt = torch.bfloat16 if dtype == "auto" else _DTYPES[dtype]
    if quantization == "auto":
        quantization = "int4" if dt == torch.bfloat16 else "none"
    if quantization != "none" and dt != torch.bfloat16:
        raise ValueError(
            f"quantization {quantization} multiplies bf16 activations: use dtype bfloat16 (or auto) with it"
        )
    return Placement(dev, dt, quantization)


def _packed_quantization(model: torch.nn.Module) -> str:
    """The weight-only quantization of a model's packed linear layers (none when it has none)."""
    from stallfree.engine.model.cpu_linear import PackedLinear  # noqa: PLC0415

    for m in model.modules():
        if isinstance(m, PackedLinear):
            return m.quantization  # the decoder's layers come first; the LM head is int8 in both modes
    return "none"
