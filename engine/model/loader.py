"""One entry point for loading a model: the bundled default, a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.paths import DEFAULT_MODEL_NAME, default_model_path


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model in eval mode with the tokenizer and config it came with; `name` is what clients call it."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: LlamaConfig
    name: str


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    load_format: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load a Llama-family model and its tokenizer.

    path: None for the bundled SmolLM2-135M-Instruct; a `.gguf` file; or a Hugging Face folder with
    config.json, *.safetensors and tokenizer.json. Nothing is downloaded.
    load_format="dummy": random weights (seeded) of the shape `path` names: a shape from
    `stallfree.engine.model.dummy.SHAPES` (default smollm2-135m), an HF config.json or a folder holding one;
    built on `device` directly. max_model_len caps the dummy model's RoPE tables.
    quantization: on the CPU in bf16, "none" keeps the linear layers as bf16 weights for the one CPU GEMM and
    "int8" / "int4" quantizes them weight-only (stallfree.engine.model.cpu_linear); fp32 is left as is.
    Raises FileNotFoundError when the path does not exist or lacks files, ValueError for unsupported
    architectures, quantization types or tokenizers.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    check_quantization(quantization, dtype, device)
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return _load(path, dtype, device, load_format=load_format, seed=seed, max_model_len=max_model_len)
    from stallfree.engine.model.cpu_linear import pack_for_cpu  # noqa: PLC0415

    # NOTE: packed from the fp32 weights, so int4 sees a GGUF's dequantized Q4 blocks exactly (not rounded
    # to bf16 first); then the rest (embedding, norms) becomes bf16.
    loaded = _load(
        path, torch.float32, device, load_format=load_format, seed=seed, max_model_len=max_model_len
    )
    pack_for_cpu(loaded.model, quantization)
    for p in loaded.model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return loaded


def check_quantization(quantization: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """ValueError unless the weight-only quantization can run: CPU, bf16 activations."""
    from stallfree.engine.model.cpu_linear import validate_quantization  # noqa: PLC0415

    validate_quantization(quantization)
    if quantization == "none":
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only; use quantization 'none'")
    if dtype != torch.bfloat16:
        raise ValueError(
            f"quantization {quantization!r} multiplies bf16 activations: use dtype bfloat16 with it"
        )


def _load(
    path: str | Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    load_format: str,
    seed: int,
    max_model_len: int | None,
) -> LoadedModel:
    if load_format == "dummy":
        from stallfree.engine.model.dummy import load_dummy  # noqa: PLC0415

        spec = "smollm2-135m" if path is None else path
        model, tokenizer, config = load_dummy(spec, dtype, device, seed=seed, max_model_len=max_model_len)
        src = Path(str(spec))  # a shape name, a folder, or a config .json (named after its folder)
        label = src.resolve().parent.name if src.suffix == ".json" else src.name
        return LoadedModel(model, tokenizer, config, f"dummy-{label}")
    if path is None:
        from stallfree.engine.model.gguf_loader import load_gguf

        model, tokenizer, config = load_gguf(default_model_path(), dtype=dtype, device=device)
        return LoadedModel(model, tokenizer, config, DEFAULT_MODEL_NAME)
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist (pass a .gguf file or a Hugging Face folder)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{path}: model files must be .gguf; for safetensors pass the folder that holds them"
            )
        from stallfree.engine.model.gguf_loader import load_gguf

        model, tokenizer, config = load_gguf(path, dtype=dtype, device=device)
        return LoadedModel(model, tokenizer, config, path.stem)
    from stallfree.engine.model.hf_loader import load_hf_folder

    model, tokenizer, config = load_hf_folder(path, dtype=dtype, device=device)
    return LoadedModel(model, tokenizer, config, path.resolve().name)
