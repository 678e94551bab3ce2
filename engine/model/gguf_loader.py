"""Load a Llama-family model from a GGUF file (llama.cpp's format), dequantizing weights into torch.

Metadata (`llama.*`, `general.architecture`, `tokenizer.*`) gives the config and tokenizer; tensors are
dequantized with the `gguf` package and renamed to Hugging Face checkpoint keys, so the model is filled by
the same mapping as a Hugging Face folder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.gguf_tokenizer import tokenizer_from_gguf_metadata
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)


@dataclass(frozen=True, slots=True)
class _Arch:
    """How a llama-shaped GGUF architecture differs from plain Llama."""

    # llama.cpp's converter permutes Q/K rows of "llama" models for its adjacent-pair RoPE; models it runs
    # with NEOX-style (rotate_half) RoPE, like Qwen2, are stored unpermuted.
    permuted_qk: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: attn_q_norm / attn_k_norm (RMSNorm over head_dim) before RoPE


ARCHITECTURES = {
    "llama": _Arch(permuted_qk=True, qkv_bias=False),
    "qwen2": _Arch(permuted_qk=False, qkv_bias=True),
    "qwen3": _Arch(permuted_qk=False, qkv_bias=False, qk_norm=True),
}

# GGUF tensor name (after "blk.N.") -> Hugging Face key (after "model.layers.N.").
_LAYER_KEYS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_KEYS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _f32(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Round-trip through the shortest
    # decimal that float32 prints to recover the value the model was trained with.
    return float(str(np.float32(value)))


def config_from_metadata(metadata: dict[str, Any], tensors: dict[str, ReaderTensor]) -> LlamaConfig:
    """LlamaConfig from GGUF metadata; raises ValueError for architectures that are not llama-shaped."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: supported are {sorted(ARCHITECTURES)} (llama-shaped)"
        )

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"GGUF metadata key {arch}.{key!r} is missing; the file is incomplete")
        return metadata[f"{arch}.{key}"]

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))
    # token_embd is stored (hidden, vocab) in GGUF's fastest-dimension-first order.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=_f32(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_token_id(metadata, "bos", vocab_size),
        eos_token_id=_token_id(metadata, "eos", vocab_size),
        qkv_bias=ARCHITECTURES[arch].qkv_bias,
        qk_norm=ARCHITECTURES[arch].qk_norm,
        rope_freq_factors=_rope_freq_factors(metadata, tensors, arch, head_dim),
    )


def _rope_freq_factors(
    metadata: dict[str, Any], tensors: dict[str, ReaderTensor], arch: str, head_dim: int
) -> tuple[float, ...] | None:
    """RoPE frequency divisors: the `rope_freqs` tensor (Llama 3.1 scaling) or linear scaling's factor."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        return tuple(float(f) for f in dequantize_tensor(tensors["rope_freqs.weight"]).reshape(-1).tolist())
    if kind == "linear":
        return (float(metadata[f"{arch}.rope.scaling.factor"]),) * (head_dim // 2)
    if kind != "none":
        raise ValueError(
            f"GGUF RoPE scaling {kind!r} is not supported (only linear and Llama 3.1 rope_freqs)"
        )
    return None


def _token_id(metadata: dict[str, Any], kind: str, vocab_size: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{kind}_token_id")
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor in PyTorch's (rows, cols) order.

    Raises ValueError for quantization types outside SUPPORTED_TYPES.
    """
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"tensor {tensor.name}: quantization type {qtype.name} is not supported ({supported})"
        )
    array = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32)
    if not array.flags.writeable:  # F32/F16 come back as views of the read-only memory-mapped file
        array = array.copy()
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation, restoring the Hugging Face rotate_half layout.

    NOTE: HF pairs dim i with dim i + hd/2 of each head for RoPE; llama.cpp pairs adjacent dims 2i, 2i+1.
    Its converter therefore reorders each head's rows from [first half | second half] to interleaved
    (row 2j <- first-half row j, row 2j+1 <- second-half row j). Here we read the rows back as
    (head, j, half) and swap to (head, half, j). Works for weights (rows, C) and biases (rows,).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_tensor_name_to_hf(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError when unknown."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_KEYS:
        return f"model.layers.{parts[1]}.{_LAYER_KEYS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_KEYS:
        return f"{_GLOBAL_KEYS[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected tensor {name!r} in a llama-shaped GGUF file")


def load_gguf_weights(
    reader: GGUFReader, config: LlamaConfig, arch: str, undo_rope_permutation: bool = True
) -> dict[str, torch.Tensor]:
    """Dequantized weights keyed by Hugging Face names, Q/K un-permuted where the converter permuted them.

    `undo_rope_permutation=False` exists only so tests can show what goes wrong without it.
    """
    permuted = ARCHITECTURES[arch].permuted_qk and undo_rope_permutation
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # RoPE scaling, already in the config
            continue
        hf_name = gguf_tensor_name_to_hf(tensor.name)
        w = dequantize_tensor(tensor)
        if permuted and ".self_attn.q_proj." in hf_name:
            w = unpermute_qk(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in hf_name:
            w = unpermute_qk(w, config.num_kv_heads)
        weights[hf_name] = w
    return weights


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    undo_rope_permutation: bool = True,
) -> tuple[LlamaForCausalLM, Tokenizer, LlamaConfig]:
    """Model, tokenizer and config from a GGUF file. Raises FileNotFoundError / ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(metadata, tensors)
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    weights = load_gguf_weights(reader, config, metadata["general.architecture"], undo_rope_permutation)
    model = LlamaForCausalLM.from_hf_state_dict(config, weights, dtype=dtype, device=device)
    logger.info(
        "loaded %s: %d layers, %.1fM parameters", path.name, config.num_layers, model.num_params() / 1e6
    )
    return model, tokenizer, config
