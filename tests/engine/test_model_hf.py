"""Hugging Face folder loading (config.json + safetensors + tokenizer.json) on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import (
    CHATML_TEMPLATE,
    hf_logits,
    make_tiny_hf_model,
    prefill_logits,
    save_hf_folder,
    train_tiny_tokenizer,
)

from stallfree.engine.model import load_model
from stallfree.engine.model.hf_loader import config_from_hf

TEXT = "Hello, world! def add(a, b): return a + b 🦀"


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return train_tiny_tokenizer()


@pytest.mark.parametrize(
    ("arch", "tie"),
    [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("qwen2", True)],
)
def test_hf_folder_logits_match_transformers(tmp_path: Path, tiny_tokenizer, arch: str, tie: bool) -> None:
    """fp32 logits at every position agree with transformers' own forward: max |diff| < 1e-4."""
    hf = make_tiny_hf_model(arch, tie=tie)
    loaded = load_model(save_hf_folder(tmp_path, hf, tiny_tokenizer))
    assert loaded.name == tmp_path.name
    assert loaded.config.tie_word_embeddings is tie and loaded.config.qkv_bias is (arch == "qwen2")
    ids = tiny_tokenizer.encode(TEXT).ids
    ours, ref = prefill_logits(loaded.model, ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4


def test_hf_folder_bfloat16(tmp_path: Path, tiny_tokenizer) -> None:
    """dtype=bfloat16 loads bf16 weights and stays close to fp32 (relative L2 error < 2%)."""
    hf = make_tiny_hf_model("llama")
    loaded = load_model(save_hf_folder(tmp_path, hf, tiny_tokenizer), dtype=torch.bfloat16)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = tiny_tokenizer.encode(TEXT).ids
    ours, ref = prefill_logits(loaded.model, ids), hf_logits(hf, ids)
    assert ours.dtype == torch.float32
    assert ((ours - ref).norm() / ref.norm()).item() < 0.02


def test_hf_folder_tokenizer(tmp_path: Path, tiny_tokenizer) -> None:
    tok = load_model(save_hf_folder(tmp_path, make_tiny_hf_model("llama"), tiny_tokenizer)).tokenizer
    assert tok.encode(TEXT) == tiny_tokenizer.encode(TEXT).ids
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids >= {2}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 2  # <|im_start|> matched whole, not split into pieces
    assert tok.chat_template == CHATML_TEMPLATE


def test_hf_folder_missing_pieces(tmp_path: Path, tiny_tokenizer) -> None:
    folder = save_hf_folder(tmp_path, make_tiny_hf_model("llama"), tiny_tokenizer)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(folder)
    tiny_tokenizer.save(str(folder / "tokenizer.json"))
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(folder)


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing the key"),
        ({"eos_token_id": 100}, "outside the vocabulary"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf({**BASE, **change})


def test_config_variants() -> None:
    llama3 = config_from_hf(
        {
            **BASE,
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
            "eos_token_id": [1, 2],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3.rope_theta == 500000.0 and llama3.eos_token_id == 1 and llama3.rope_scaling.factor == 8.0
    v5 = config_from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
    assert v5.rope_theta == 1234.0 and v5.rope_scaling is None and v5.head_dim == 16
    mistral = config_from_hf(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
        }
    )
    assert mistral.max_position_embeddings == 4096  # full-causal attention is exact only inside the window
    assert json.loads(json.dumps(BASE)) == BASE  # BASE was not mutated


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path, tiny_tokenizer) -> None:
    """Llama 3.1 frequency scaling: logits match transformers (max |diff| < 1e-4); without it they don't."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = make_tiny_hf_model("llama", rope_parameters=rope)
    folder = save_hf_folder(tmp_path, hf, tiny_tokenizer)
    loaded = load_model(folder)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.factor == 4.0
    ids = tiny_tokenizer.encode(TEXT).ids
    ref = hf_logits(hf, ids)
    assert (prefill_logits(loaded.model, ids) - ref).abs().max().item() < 1e-4
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    unscaled = load_model(folder)
    assert unscaled.config.rope_scaling is None
    assert (prefill_logits(unscaled.model, ids) - ref).abs().max().item() > 1e-2


def test_linear_rope_scaling_hf_folder(tmp_path: Path, tiny_tokenizer) -> None:
    hf = make_tiny_hf_model(
        "llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    )
    loaded = load_model(save_hf_folder(tmp_path, hf, tiny_tokenizer))
    assert loaded.config.rope_freq_factors == (2.0,) * 8 and loaded.config.rope_scaling is None
    ids = tiny_tokenizer.encode(TEXT).ids
    assert (prefill_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
