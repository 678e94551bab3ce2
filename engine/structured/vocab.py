"""The model's vocabulary as the bytes each token stands for: what the grammar engine matches against.

A grammar speaks about text, the sampler about token ids; the bridge is, for every id, the exact bytes the
token adds to the output. The tokenizer's own strings are not those bytes:
  byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2): each byte is stored as a printable stand-in character
      ("Ġ" for a space), so the bytes come back through the inverse of GPT-2's byte-to-unicode table;
  SentencePiece with byte fallback (Llama 2, Mistral): "▁" is a space and "<0x0A>" is the byte 0x0A;
  added tokens are literal text (`<tool_call>`), except special ones (`<|im_start|>`, `<s>`), which
      decode to nothing: they get no bytes, so the grammar never lets one into the text.
Stop tokens are passed separately: the grammar allows them only where the output may end.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from stallfree.engine.model.tokenizer import Tokenizer

SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for d in decoder.get("decoders", []) or []:
        types |= _decoder_types(d)
    return types


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """bytes of every token id in [0, tokenizer.vocab_size): b"" for special tokens."""
    spec = json.loads(tokenizer.backend.to_str())
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    kinds = _decoder_types(spec.get("decoder"))
    byte_decoder = _byte_decoder()
    out: list[bytes] = []
    for i in range(tokenizer.vocab_size):
        if i in added:
            out.append(b"" if added[i]["special"] else added[i]["content"].encode())
            continue
        piece = tokenizer.id_to_token(i)
        if piece is None:
            out.append(b"")
        elif "ByteLevel" in kinds:
            out.append(bytes(byte_decoder[c] for c in piece) if all(c in byte_decoder for c in piece)
                       else piece.encode())  # fmt: skip
        elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace(SPACE, " ").encode())
    return out


def adds_prefix_space(tokenizer: Tokenizer) -> bool:
    """True when the tokenizer prepends "▁" to a text (SentencePiece's add_space_prefix)."""
    spec = json.loads(tokenizer.backend.to_str())
    return SPACE in json.dumps(spec.get("normalizer") or {}) and "Prepend" in json.dumps(
        spec.get("normalizer")
    )
