"""Build a `Tokenizer` from the `tokenizer.*` metadata of a GGUF file.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`, `token_type`, `merges` or `scores`, special ids) and
the name of the pre-tokenizer llama.cpp should use (`tokenizer.ggml.pre`), not a tokenizer.json. We rebuild
the equivalent `tokenizers` pipeline: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the split
rules of the named model family, or SentencePiece BPE with byte fallback (`"llama"`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
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

    Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2 vocabularies)
    and SentencePiece BPE with byte fallback (`"llama"`: Llama 2, Mistral, TinyLlama). Raises ValueError
    for other tokenizer models (unigram "t5", WordPiece, ...): load such a model from its Hugging Face
    folder instead, whose tokenizer.json describes it fully.
    """
    kind = _get(metadata, "tokenizer.ggml.model")
    tokens: list[str] = list(_get(metadata, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
    if kind == "gpt2":
        tok = _byte_level_bpe(metadata, tokens)
        add_bos_default = False
    elif kind == "llama":
        tok = _sentencepiece_bpe(metadata, tokens, token_types)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE and 'llama' "
            "SentencePiece BPE); load this model from a Hugging Face folder with a tokenizer.json instead"
        )
    # Control tokens (<|im_start|>, <s>, ...) are matched whole before BPE and skipped when decoding with
    # skip_special_tokens; user-defined ones are matched whole but kept.
    pairs = list(zip(tokens, token_types, strict=True))
    special = [t for t, tt in pairs if tt in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False) for t, tt in pairs if tt == TOKEN_USER_DEFINED])

    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    # What encode(add_special_tokens=True) puts around the text: BOS and/or EOS, as the file asks.
    around: list[tuple[str, int]] = []
    if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", add_bos_default):
        around.append((tokens[bos], int(bos)))
    head = f"{around[0][0]} " if around else ""
    tail = ""
    if eos is not None and metadata.get("tokenizer.ggml.add_eos_token", False):
        around.append((tokens[eos], int(eos)))
        tail = f" {tokens[eos]}"
    if around:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}", special_tokens=around
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


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    """GPT-2-style BPE over bytes mapped to printable characters, with the named pre-tokenizer."""
    merges = [tuple(m.split(" ", 1)) for m in _get(metadata, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return tok


SPACE = "\u2581"  # "▁": SentencePiece's visible stand-in for a space


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it, expressed as a `tokenizers` BPE with byte fallback.

    llama.cpp starts from single characters and repeatedly merges the adjacent pair whose concatenation
    is the highest-scoring vocabulary piece; characters outside the vocabulary become <0xXX> byte tokens.
    Ranked BPE merges do the same when every way of building a piece from two pieces is ranked by the
    built piece's score (ties: leftmost first in both). Spaces become "▁", and with add_space_prefix
    every text fragment (the first, and each after a special token) gets a leading "▁".
    """
    scores: list[float] = list(_get(metadata, "tokenizer.ggml.scores"))
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, tt in zip(tokens, token_types, strict=True) if tt == TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece in normal:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[vocab[piece]], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if add_prefix else []),
        ]
    )
    return tok
