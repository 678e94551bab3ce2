"""Load a Llama-family model from a Hugging Face folder: config.json, *.safetensors, tokenizer.json.

Supported architectures: LlamaForCausalLM (Llama 2/3, SmolLM2), MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM (dense). Weights stream tensor by tensor to the device (`safetensors_stream`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from stallfree.engine.model.config import Llama3RopeScaling, LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model.safetensors_stream import load_streamed
from stallfree.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _first_id(value: Any) -> int | None:
    """HF configs give eos_token_id as an int or a list of ints."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def config_from_hf(cfg: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig from a config.json dict; ValueError for unsupported architectures or features."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: supported are {ARCHITECTURES}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act {cfg['hidden_act']!r} is not supported: this model implements SwiGLU (silu)"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("config.json sets mlp_bias, which this Llama implementation does not support")
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json sets use_sliding_window: only full causal attention is implemented")
    hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    # Newer transformers write RoPE settings under rope_parameters; older ones rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" and window and window < max_pos:
        # Within the window, sliding-window attention is plain causal attention: cap the context there.
        logger.warning(
            "sliding_window=%d: limiting the context to %d tokens (attention is full-causal)", window, window
        )
        max_pos = int(window)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    # Qwen3 (dense) is Llama plus q/k norms: attention_bias, when set, covers q/k/v and o_proj as in Llama.
    is_qwen3 = arch == "Qwen3ForCausalLM"
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    scaling = cfg.get("rope_scaling") or rope
    freq_factors = None
    if (
        scaling.get("rope_type", scaling.get("type")) == "linear"
    ):  # positions / factor == frequencies / factor
        freq_factors = (float(scaling["factor"]),) * (head_dim // 2)
        scaling = None
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if is_qwen2 or is_qwen3 else 1e-5)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=Llama3RopeScaling.from_dict(scaling),
        rope_freq_factors=freq_factors,
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_proj_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
        qk_norm=is_qwen3,
    )


def _special_token_id(tok: HFTokenizer, value: Any) -> int | None:
    """tokenizer_config.json names special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def tokenizer_from_hf(folder: Path, config: LlamaConfig) -> Tokenizer:
    """Tokenizer from tokenizer.json, with special tokens and chat template from tokenizer_config.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (slow tokenizers are not supported)")
    tok = HFTokenizer.from_file(str(path))
    tcfg = (
        _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    )
    chat_template = tcfg.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        by_name = {t["name"]: t["template"] for t in chat_template}
        chat_template = by_name.get("default", next(iter(by_name.values()), None))
    if chat_template is None and (folder / "chat_template.jinja").is_file():
        chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    bos = _special_token_id(tok, tcfg.get("bos_token"))
    eos = _special_token_id(tok, tcfg.get("eos_token"))
    # generation_config.json lists every id that ends a turn (e.g. Llama 3's <|eot_id|> and <|end_of_text|>).
    extra: list[int] = []
    if (folder / "generation_config.json").is_file():
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = [int(i) for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if i is not None]
    return Tokenizer(
        tok,
        bos_token_id=bos if bos is not None else config.bos_token_id,
        eos_token_id=eos if eos is not None else config.eos_token_id,
        chat_template=chat_template,
        extra_stop_token_ids=extra,
    )


def load_hf_folder(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[LlamaForCausalLM, Tokenizer, LlamaConfig]:
    """Model, tokenizer and config from a Hugging Face model folder. Raises FileNotFoundError / ValueError."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    config = config_from_hf(_read_json(folder / "config.json"))
    tokenizer = tokenizer_from_hf(folder, config)
    model = load_streamed(config, folder, dtype, device)
    logger.info("loaded %s: %d layers, %.1fM parameters", folder, config.num_layers, model.num_params() / 1e6)
    return model, tokenizer, config
