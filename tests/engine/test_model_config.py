"""LlamaConfig refuses impossible architectures with a message that says what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stallfree.engine.model import Llama3RopeScaling, LlamaConfig, LlamaForCausalLM

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"num_layers": -1}, "num_layers must be a positive integer"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"rope_theta": 0.0}, "rope_theta must be a positive number"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be in"),
        ({"eos_token_id": 64}, "outside the vocabulary"),
        ({"rope_freq_factors": (1.0, 2.0)}, "must be 4 positive numbers"),
        (
            {"rope_freq_factors": (1.0,) * 4, "rope_scaling": Llama3RopeScaling(8.0, 1.0, 4.0, 8192)},
            "either rope_scaling or rope_freq_factors",
        ),
    ],
)
def test_invalid_configs(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**TINY, **change})


def test_config_is_frozen_and_sizes_add_up() -> None:
    cfg = LlamaConfig(**TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]
    assert (cfg.q_size, cfg.kv_size, cfg.num_queries_per_kv) == (32, 16, 2)
    model = LlamaForCausalLM(cfg)
    # embed + lm_head + per layer (qkv, o, gate_up, down, 2 norms) + final norm
    per_layer = 32 * (32 + 2 * 16) + 32 * 32 + 32 * 2 * 48 + 48 * 32 + 2 * 32
    assert model.num_params() == 2 * 64 * 32 + 2 * per_layer + 32
    assert model.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 8 * 2
    tied = LlamaForCausalLM(dataclasses.replace(cfg, tie_word_embeddings=True))
    assert tied.num_params() == model.num_params() - 64 * 32


def test_forward_shapes_and_dtypes() -> None:
    """(T,) ids and positions in, (T, C) hidden out; logits are float32 whatever the weights' dtype."""
    from model_fixtures import DenseCausalAttention

    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaForCausalLM(LlamaConfig(**TINY)).to(dtype).eval()
        with torch.no_grad():
            hidden = model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), DenseCausalAttention())
            logits = model.compute_logits(hidden[-1:])
        assert hidden.shape == (3, 32) and hidden.dtype == dtype
        assert logits.shape == (1, 64) and logits.dtype == torch.float32
