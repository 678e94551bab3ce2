"""Llama-family model, weight loaders (GGUF, Hugging Face folder) and tokenizer.

from stallfree.engine.model import load_model
loaded = load_model(None)                     # the bundled SmolLM2-135M-Instruct GGUF
hidden = loaded.model(input_ids, positions, attn)   # attn: an AttentionFn owning the KV cache
logits = loaded.model.compute_logits(hidden[-1:])
"""

from stallfree.engine.model.config import Llama3RopeScaling, LlamaConfig
from stallfree.engine.model.llama import AttentionFn, LlamaForCausalLM
from stallfree.engine.model.loader import LoadedModel, load_model
from stallfree.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "AttentionFn",
    "IncrementalDetokenizer",
    "Llama3RopeScaling",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LoadedModel",
    "Tokenizer",
    "load_model",
]
