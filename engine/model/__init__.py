"""Llama-family model, weight loaders (GGUF, Hugging Face folder) and tokenizer."""
