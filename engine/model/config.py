"""Architecture hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type: "llama3"` in a Hugging Face config.json).

    Low frequencies (long wavelengths) are divided by `factor`, high frequencies are kept, and the band in
    between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must be greater than low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError("rope_scaling.original_max_position_embeddings must be >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Llama3RopeScaling | None:
        """Parse a Hugging Face `rope_scaling` / `rope_parameters` dict; None or "default" means no scaling.

        Raises ValueError for rope types other than "default" and "llama3" (linear, dynamic, yarn, ...).
        """
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type != "llama3":
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}: only 'default' and 'llama3' are implemented"
            )
        try:
            return cls(
                factor=float(d["factor"]),
                low_freq_factor=float(d["low_freq_factor"]),
                high_freq_factor=float(d["high_freq_factor"]),
                original_max_position_embeddings=int(d["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling is missing the key {e.args[0]!r}") from e


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Everything needed to build `LlamaForCausalLM`; built once by a loader and never mutated."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    # Per-frequency divisors of the rotary frequencies (hd/2 values), as llama.cpp applies them: GGUF files
    # carry Llama 3.1 scaling as a `rope_freqs` tensor, and linear scaling is every divisor = factor.
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Qwen2 has biases on q/k/v (not on o_proj); Llama's `attention_bias: true` puts one on o_proj too.
    qkv_bias: bool = False
    o_proj_bias: bool = False
    # Qwen3: RMSNorm over head_dim (one weight shared by every head) on each query and key head, before RoPE.
    qk_norm: bool = False

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if not (0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.rope_freq_factors is not None:
            if self.rope_scaling is not None:
                raise ValueError("give either rope_scaling or rope_freq_factors, not both")
            if len(self.rope_freq_factors) != self.head_dim // 2 or min(self.rope_freq_factors) <= 0:
                raise ValueError(
                    f"rope_freq_factors must be {self.head_dim // 2} positive numbers (head_dim / 2), "
                    f"got {len(self.rope_freq_factors)}"
                )
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one key/value head (1 = multi-head, num_heads = multi-query)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K plus V cache one token occupies across all layers, for elements of `element_size`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
