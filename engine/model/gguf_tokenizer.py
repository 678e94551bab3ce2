"""Build a `Tokenizer` from the `tokenizer.*` metadata of a GGUF file.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`, `token_type`, `merges`, special ids) and the name of
the pre-tokenizer llama.cpp should use (`tokenizer.ggml.pre`), not a tokenizer.json. We rebuild the
equivalent `tokenizers` pipeline: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer
split rules of the named model family.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from stallfree.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split rules, by `tokenizer.ggml.pre`. Text is split into words by this regex before BPE
# runs inside each word.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for llama.cpp's pre-tokenizer name `pre` (GPT-2 rules for unknown names)."""

    def split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    if pre in ("smollm", "starcoder", "refact"):
        # Every digit is its own word, then GPT-2 rules (SmolLM2's tokenizer.json does exactly this).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        return split_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return split_then_bytes(_QWEN2_SPLIT)
    if pre not in ("gpt-2", "gpt2", "default", ""):
        logger.warning("unknown GGUF pre-tokenizer %r: using GPT-2 split rules; tokens may differ", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _get(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"the GGUF file has no tokenizer: metadata key {key!r} is missing")
    return metadata[key]


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build the model's tokenizer from GGUF metadata (a key -> value mapping of `tokenizer.*` fields).

    Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2 vocabularies).
    Raises ValueError for other tokenizer models (SentencePiece "llama", "t5", ...): load such a model
    from its Hugging Face folder instead, whose tokenizer.json describes it fully.
    """
    kind = _get(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "load this model from a Hugging Face folder with a tokenizer.json instead"
        )
    tokens: list[str] = list(_get(metadata, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _get(metadata, "tokenizer.ggml.merges")]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|eot_id|>, ...) are matched whole before BPE and skipped when decoding
    # with skip_special_tokens; user-defined ones are matched whole but kept.
    pairs = list(zip(tokens, token_types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, tt in pairs if tt == TOKEN_CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, tt in pairs if tt == TOKEN_USER_DEFINED])

    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B", special_tokens=[(bos_text, bos)]
        )
    extra_stops = [
        metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata
    ]
    return Tokenizer(
        tok,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=metadata.get("tokenizer.chat_template"),
        extra_stop_token_ids=extra_stops,
    )
