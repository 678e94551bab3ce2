"""Helpers for the model tests: a dense single-sequence attention, a greedy loop, tiny HF/GGUF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from tokenizers import Tokenizer
from torch import Tensor

from stallfree.engine.model.llama import LlamaForCausalLM


class DenseCausalAttention:
    """An `AttentionFn` for one sequence: keeps every layer's K/V and attends causally over all of it.

    Calls may feed the sequence in pieces (whole prompt, chunks, or token by token); each call's queries
    see the K/V of all earlier calls plus the causal part of their own. GQA groups query heads by a
    reshape, without repeating K/V.
    """

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k])  # (S, nkv, hd)
            v = torch.cat([self.v[layer_idx], v])
        self.k[layer_idx], self.v[layer_idx] = k, v
        T, nh, hd = q.shape
        S, nkv, _ = k.shape
        # Query i of this call is token S - T + i of the sequence: it sees keys 0 .. S - T + i.
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        qg = q.view(T, nkv, nh // nkv, hd).permute(1, 2, 0, 3)  # (nkv, group, T, hd)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1), attn_mask=mask
        )  # (nkv, group, T, hd); K/V broadcast over the group dimension
        return out.permute(2, 0, 1, 3).reshape(T, nh, hd)


@torch.no_grad()
def prefill_logits(model: LlamaForCausalLM, ids: list[int], start_pos: int = 0) -> Tensor:
    """All-position logits (T, vocab) of one sequence fed in one call."""
    hidden = model(torch.tensor(ids), torch.arange(start_pos, start_pos + len(ids)), DenseCausalAttention())
    return model.compute_logits(hidden)


@torch.no_grad()
def greedy(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `ids` (prefill once, then one token per call)."""
    attn = DenseCausalAttention()
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
    out: list[int] = []
    next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
    for _ in range(max_new_tokens):
        out.append(next_id)
        pos = len(ids) + len(out) - 1
        hidden = model(torch.tensor([next_id]), torch.tensor([pos]), attn)
        next_id = int(model.compute_logits(hidden).argmax(-1))
    return out


# ---------------------------------------------------------------------------------------------------------
# Tiny checkpoints written on the fly: a byte-level BPE tokenizer, random HF models, GGUF files.

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (HF configs' bos=1, eos=2)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! Héllo, wörld! naïve café 日本語 🦀 ",
    "the theory of the thing is that the other three think so",
]


def train_tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer trained on a few sentences (all 256 bytes + some merges)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return tok


# Qwen2/Qwen3's tokenizer.json split rule (before byte-level BPE): digits one by one, letters with at most
# one leading non-letter, punctuation runs, newlines kept together.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_qwen_style_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE tokenizer laid out as Qwen2/Qwen3's tokenizer.json is: NFC normaliser, the Qwen
    split regex then ByteLevel without its own regex, and the special tokens appended after the BPE
    vocabulary (<|endoftext|>, <|im_start|>, <|im_end|> are the last three ids, as in Qwen's)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def bpe_vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """(tokens by id, added tokens included; merges as "a b" strings) of a byte-level BPE tokenizer."""
    data = json.loads(tok.to_str())
    model = data["model"]
    by_id: dict[int, str] = {i: text for text, i in model["vocab"].items()}
    by_id.update({t["id"]: t["content"] for t in data.get("added_tokens", [])})
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def make_tiny_hf_model(
    arch: str = "llama", tie: bool = False, seed: int = 0, vocab_size: int = 320, **config_kw: Any
) -> Any:
    """A random 2-layer transformers model (hidden 64, 4 heads, 2 KV heads) with non-trivial weights.

    arch: "llama", "mistral", "qwen2" (q/k/v biases) or "qwen3" (q/k norms); config_kw go to the
    transformers config (overriding these defaults). Every weight is redrawn, biases and norms included, so a
    mis-mapped or mis-permuted tensor shows up in the logits.
    """
    import transformers

    cls_names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in cls_names[arch])
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = config_cls(**{**fields, **config_kw})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: per head, interleave the two rotary halves.

    Rows [a0 .. a(h/2-1), b0 .. b(h/2-1)] of each head become [a0, b0, a1, b1, ...].
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, *module, kind = hf_name.split(".")
        return f"blk.{i}.{_HF_TO_GGUF['.'.join(module)]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        hf_name, "output.weight"
    )


def write_gguf(
    path: Path,
    hf_model: Any,
    tok: Tokenizer,
    arch: str = "llama",
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    permute: bool = True,
    rope_freqs: np.ndarray | None = None,
    linear_rope_factor: float | None = None,
    tokenizer_pre: str = "gpt-2",
    special_tokens: tuple[str, ...] = tuple(SPECIAL_TOKENS),
    bos_eos: tuple[int, int] = (1, 2),
) -> Path:
    """Write a transformers model and tokenizer as llama.cpp's converter would (Q/K permuted for "llama").

    Matrices are stored as `qtype` (1-D tensors stay F32, as llama.cpp keeps norms); tied embeddings mean
    no output.weight. RoPE scaling as llama.cpp stores it: `rope_freqs` (Llama 3.1 frequency divisors) or
    linear scaling metadata. A head_dim other than hidden / heads goes in key_length / value_length.
    """
    cfg = hf_model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w = GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if linear_rope_factor is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope_factor)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.ascontiguousarray(rope_freqs, dtype=np.float32))
    tokens, merges = bpe_vocab_and_merges(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special_tokens else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(bos_eos[0])
    w.add_eos_token_id(bos_eos[1])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if permute and arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif permute and arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
        else:
            w.add_tensor(_gguf_name(name), quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_hf_folder(folder: Path, hf_model: Any, tok: Tokenizer) -> Path:
    """save_pretrained (safetensors) plus tokenizer.json and a tokenizer_config.json with a chat template."""
    hf_model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE})
    )
    return folder


@torch.no_grad()
def hf_logits(hf_model: Any, ids: list[int]) -> Tensor:
    """All-position float32 logits (T, vocab) of a transformers model."""
    return hf_model(torch.tensor([ids])).logits[0].float()
