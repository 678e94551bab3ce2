"""GGUF tokenizers rebuilt from metadata, against independent references.

SentencePiece ("llama" vocabularies: Llama 2, Mistral): a tiny model trained with the sentencepiece
package, exported to GGUF metadata as llama.cpp's converter does; token ids must equal sentencepiece's own.
Byte-level BPE ("gpt2"): the GGUF rebuild must equal the tokenizer.json it came from.
"""

from __future__ import annotations

import io

import pytest
from model_fixtures import CHATML_TEMPLATE, SPECIAL_TOKENS, bpe_vocab_and_merges, train_tiny_tokenizer

from stallfree.engine.model import IncrementalDetokenizer
from stallfree.engine.model.gguf_tokenizer import tokenizer_from_gguf_metadata

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 1234",
    "Hello, world! naïve café, the other three think so.",
    "the theory of the thing is that the other three think so",
]
STRINGS = [
    "hello world",
    "the thing is that the theory",
    "Hello, world!\nnew line",
    "def f(x):\n    return x + 1",
    "digits 1234567",
    "  two  spaces and    four",
    "naïve café",
    "unseen 日本語 🦀 characters",
    "<s>after a control token",
    "",
]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "whitespace-pieces"])
def sentencepiece_model(request):
    """Trained both ways: Llama 2 also has whitespace-only pieces ("▁▁▁▁" for code indentation)."""
    spm = pytest.importorskip("sentencepiece")
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 50),
        model_writer=proto,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,  # as Llama 2 / Mistral: unknown characters become <0xXX> tokens
        split_digits=True,
        character_coverage=1.0,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=request.param,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _gguf_metadata_from_sentencepiece(sp) -> dict:
    """The tokenizer.* metadata llama.cpp's converter writes for a SentencePiece model."""
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


@pytest.mark.parametrize("text", STRINGS)
def test_sentencepiece_ids_match_sentencepiece(sentencepiece_model, text: str) -> None:
    sp = sentencepiece_model
    tok = tokenizer_from_gguf_metadata(_gguf_metadata_from_sentencepiece(sp))
    if text.startswith("<s>"):
        # sentencepiece itself never parses control tokens out of text; llama.cpp (and we) do, and start
        # the following fragment with a space prefix as if it began the text.
        expected = [sp.bos_id(), sp.bos_id(), *sp.encode(text[3:])]
    else:
        expected = [sp.bos_id(), *sp.encode(text)]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == expected[1:]
    assert tok.decode(expected) == sp.decode(expected)


def test_sentencepiece_streaming_and_bytes(sentencepiece_model) -> None:
    sp = sentencepiece_model
    tok = tokenizer_from_gguf_metadata(_gguf_metadata_from_sentencepiece(sp))
    text = "the unseen 日本語 and 🦀 in the theory"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback was exercised
    detok = IncrementalDetokenizer(tok, context_ids=tok.encode("prompt:"))
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    # Mid-text, the first token's "▁" is a real space: the context keeps it from being stripped.
    assert "".join(deltas) == " " + tok.decode(ids) == " " + text


def test_byte_level_gguf_rebuild_equals_tokenizer_json() -> None:
    reference = train_tiny_tokenizer()
    tokens, merges = bpe_vocab_and_merges(reference)
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    tok = tokenizer_from_gguf_metadata(metadata)
    for text in [*STRINGS, "<|im_start|>user\nhi<|im_end|>\n", "  many   spaces\t\ttabs\r\n"]:
        assert tok.encode(text) == reference.encode(text).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # control tokens skipped
    with_bos = tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]


def test_unsupported_tokenizer_models_are_refused() -> None:
    with pytest.raises(ValueError, match="tokenizer model 't5' is not supported"):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="has no tokenizer"):
        tokenizer_from_gguf_metadata({})
