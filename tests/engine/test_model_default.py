"""The bundled SmolLM2-135M-Instruct GGUF against an independent reference: transformers' own GGUF loader.

Tolerances (fp32, CPU): all-position logits agree within max |diff| < 1e-3 while logits are O(30) (measured
~1e-4: the same dequantized weights, summed in a different order) and the argmax is identical everywhere.
Token ids agree exactly with transformers' GGUF tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import DenseCausalAttention, greedy, prefill_logits

from stallfree.engine.model import IncrementalDetokenizer
from stallfree.engine.paths import default_model_path

LOGIT_ATOL = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a land far, far away, there lived a dragon who loved to read books. " * 3,
]
STRINGS = [
    "Hello world",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\n",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "Emoji 🦀🚀👩‍👩‍👧 and flags 🇫🇷",
    "x = [1, 22, 333, 4444]; y = x[-1] ** 2 // 7  # 12345678901",
    "class Foo:\n    def __init__(self) -> None:\n        self.bar = {'a': 1}\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've they're it's HELLO'S",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    """A folder holding (a link to) the default GGUF, as transformers wants a folder plus a file name."""
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "model.gguf").symlink_to(default_model_path())
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="model.gguf")


def _transformers_gguf_model(gguf_dir: Path):
    """The reference: transformers' own GGUF reading, dequantization and Q/K un-permutation, in fp32.

    from_pretrained(gguf_file=...) needs the accelerate package; without it, build the model from the
    GGUF-derived config and load the tensors transformers dequantizes (the same code path underneath).
    """
    transformers = pytest.importorskip("transformers")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(gguf_dir, gguf_file="model.gguf")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(gguf_dir / "model.gguf", return_tensors=True, model_to_load=model)
        model.load_state_dict(tensors["tensors"], strict=False)
        model.tie_weights()
        return model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="model.gguf", dtype=torch.float32
    ).eval()


@pytest.mark.slow
def test_logits_match_transformers_gguf(default_model, gguf_dir: Path) -> None:
    ref_model = _transformers_gguf_model(gguf_dir)
    assert ref_model.lm_head.weight.data_ptr() == ref_model.model.embed_tokens.weight.data_ptr()  # tied
    for prompt in PROMPTS:
        ids = default_model.tokenizer.encode(prompt)
        ours = prefill_logits(default_model.model, ids)
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].float()
        assert ref.abs().max() > 10
        assert (ours - ref).abs().max().item() < LOGIT_ATOL, prompt
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("text", STRINGS)
def test_token_ids_match_transformers_gguf(default_model, hf_tokenizer, text: str) -> None:
    tok = default_model.tokenizer
    assert tok.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text)) == hf_tokenizer.decode(tok.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(default_model, hf_tokenizer, messages) -> None:
    tok = default_model.tokenizer
    text = tok.apply_chat_template(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat(messages) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_special_tokens_and_sizes(default_model) -> None:
    tok, model, cfg = default_model.tokenizer, default_model.model, default_model.config
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.stop_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.vocab_size == cfg.vocab_size == 49152
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert model.kv_bytes_per_token(torch.float16) == 2 * 30 * 3 * 64 * 2
    assert model.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    assert 134e6 < model.num_params() < 135e6  # tied embedding counted once


def test_greedy_answers(default_model) -> None:
    tok = default_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = greedy(default_model.model, ids, 8)
    assert "Paris" in tok.decode(out)


@torch.no_grad()
def test_absolute_positions(default_model) -> None:
    """Token-by-token and chunked feeding equal one-shot prefill (fp32: max |diff| < 1e-3); restarting
    positions at 0 for each piece does not (the rotary phase is wrong, logits move by > 0.1)."""
    model, tok = default_model.model, default_model.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to see the river.")
    full = prefill_logits(model, ids)

    def feed(pieces: list[list[int]], restart_positions: bool) -> torch.Tensor:
        attn, outs, start = DenseCausalAttention(), [], 0
        for piece in pieces:
            first = 0 if restart_positions else start
            hidden = model(torch.tensor(piece), torch.arange(first, first + len(piece)), attn)
            outs.append(model.compute_logits(hidden))
            start += len(piece)
        return torch.cat(outs)

    one_by_one = [[i] for i in ids]
    chunks = [ids[i : i + 5] for i in range(0, len(ids), 5)]
    assert (feed(one_by_one, False) - full).abs().max().item() < LOGIT_ATOL
    assert (feed(chunks, False) - full).abs().max().item() < LOGIT_ATOL
    assert (feed(one_by_one, True)[1:] - full[1:]).abs().amax(-1).min().item() > 0.1
    assert (feed(chunks, True)[5:] - full[5:]).abs().amax(-1).min().item() > 0.1


@pytest.mark.parametrize("text", STRINGS)
def test_incremental_detokenizer_reassembles_the_text(default_model, text: str) -> None:
    tok = default_model.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_back_split_characters(default_model) -> None:
    tok = default_model.tokenizer
    ids = tok.encode("🦀")
    assert len(ids) > 1  # a 4-byte character split over byte-level tokens
    detok = IncrementalDetokenizer(tok, context_ids=tok.encode("Rust "))
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦀"
    # An incomplete character at the very end comes out as U+FFFD only when flushed.
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "" and detok.flush() == "\ufffd"


def test_chat_template_errors(default_model) -> None:
    from stallfree.engine.model import Tokenizer

    tok = default_model.tokenizer
    strict = Tokenizer(
        tok.backend,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    # The template runs sandboxed: no reaching Python internals, no mutating the caller's messages.
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}"):
        sandboxed = Tokenizer(tok.backend, bos_token_id=None, eos_token_id=None, chat_template=template)
        with pytest.raises(ValueError, match="unsafe"):
            sandboxed.apply_chat_template([])
    plain = Tokenizer(tok.backend, bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])
