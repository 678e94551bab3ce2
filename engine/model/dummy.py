"""Random-weight models of a named shape (vLLM's `load_format="dummy"`), for benchmarks without weights.

The weights are built on the target device directly (an 8B model in bf16 appears in GPU memory in seconds,
where writing and reading a checkpoint would take minutes), seeded, and scaled so that logits stay finite
and flat: hidden states stay O(1) through every layer, so greedy near-ties are common and outputs should be
compared by logprobs with tolerances, never as text.

The tokenizer is a synthetic WordLevel vocabulary ("t0", "t1", ... split on whitespace) unless a Hugging Face
folder with a tokenizer.json is given: it round-trips token ids, which is all a benchmark needs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM, RotaryEmbedding
from stallfree.engine.model.tokenizer import Tokenizer

# Named shapes: the architecture hyper-parameters of well-known checkpoints (from their config.json files).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "mistral-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-5,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen3-8B: q/k norms, head_dim 128 (= hidden / heads here), untied.
    "qwen3-8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        qk_norm=True,
    ),
    # A few layers of the 8B geometry (head_dim 128, GQA 4): CUDA kernel tests at the 8B's head shapes.
    "tiny-hd128": dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
NUM_SPECIAL = 3  # ids 0, 1, 2: <|endoftext|> (pad), <s> (bos), </s> (eos) in the synthetic vocabulary


def dummy_config(spec: str | Path, max_model_len: int | None = None) -> LlamaConfig:
    """A LlamaConfig from a shape name (see SHAPES), an HF config.json, or a folder that holds one.

    max_model_len, when given, caps max_position_embeddings (the RoPE tables are built that long).
    Raises ValueError naming the known shapes when `spec` is neither.
    """
    name = str(spec)
    if name in SHAPES:
        fields = dict(SHAPES[name])
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"--load-format dummy needs a named shape ({', '.join(SHAPES)}) or an HF config.json "
                f"(or a folder holding one); {name!r} is neither"
            )
        from stallfree.engine.model.hf_loader import config_from_hf  # noqa: PLC0415 - only for files

        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            c = config_from_hf(cfg)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a Hugging Face config.json (missing or bad field {e})") from e
        fields = {f: getattr(c, f) for f in LlamaConfig.__dataclass_fields__}
    if max_model_len is not None:
        fields["max_position_embeddings"] = min(fields["max_position_embeddings"], max_model_len)
    return LlamaConfig(**fields)


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A WordLevel tokenizer: "t123" <-> id 123, words split on whitespace; ids 0-2 are special tokens."""
    vocab = {"<|endoftext|>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(NUM_SPECIAL, vocab_size)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders  # noqa: PLC0415

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(["<|endoftext|>", "<s>", "</s>"])
    return Tokenizer(tok, bos_token_id=1, eos_token_id=2)


@torch.no_grad()
def build_dummy_model(
    config: LlamaConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> LlamaForCausalLM:
    """Random weights for `config`, created on `device` in `dtype` (no CPU round trip), seeded.

    Linear weights are N(0, 1/fan_in) scaled by 1/sqrt(2 * layers) for the residual branches' outputs, so
    the residual stream grows slowly with depth; norms are ones; embeddings N(0, 1), or N(0, 1/hidden) when
    tied (they are the LM head then). Logits of the final (normalised) hidden states are then O(1) whatever
    the size (std ~1 measured on smollm2-135m and tiny-hd128): finite in bf16 and fp16.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    depth = 1.0 / math.sqrt(2 * config.num_layers)
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        elif name.endswith("embed_tokens.weight"):
            # NOTE: tied, the embedding is the LM head too: logits h . e_v of an RMS-normed h (norm sqrt(C))
            # are O(1) only with std 1/sqrt(C); N(0, 1) made them O(sqrt(C)) and the model echoed its input.
            t.normal_(0.0, 1.0 / math.sqrt(p.shape[1]) if config.tie_word_embeddings else 1.0, generator=gen)
        else:
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= depth
            t.normal_(0.0, std, generator=gen)
        params[name] = t
    model.load_state_dict(params, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config, device=device)
    return model.eval()


def load_dummy(
    spec: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_model_len: int | None = None,
) -> tuple[LlamaForCausalLM, Tokenizer, LlamaConfig]:
    """Model, tokenizer and config for `--load-format dummy` (see the module docstring)."""
    config = dummy_config(spec, max_model_len)
    folder = Path(str(spec)).expanduser()
    if folder.is_file():
        folder = folder.parent
    if str(spec) not in SHAPES and (folder / "tokenizer.json").is_file():
        from stallfree.engine.model.hf_loader import tokenizer_from_hf  # noqa: PLC0415

        tokenizer = tokenizer_from_hf(folder, config)
    else:
        tokenizer = synthetic_tokenizer(config.vocab_size)
    return build_dummy_model(config, dtype, device, seed), tokenizer, config
