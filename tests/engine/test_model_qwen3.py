"""Qwen3 dense (Qwen3ForCausalLM): q/k RMSNorm per head before RoPE, head_dim independent of hidden / heads.

The checkpoint is a random-weight Qwen3 written by transformers itself (no real one can be installed here),
with every weight redrawn (norms included) and head_dim 32 where hidden / heads is 16, and a byte-level BPE
tokenizer.json laid out as Qwen's. Logits are compared with transformers' own forward, at the tolerance the
Llama tests use (fp32, max |diff| < 1e-4), from the Hugging Face folder and from a GGUF that the `gguf`
package's writer made of the same model; and through the engine on every backend (torch, the C++ cpu
kernels, the Triton kernels in the interpreter) with chunked prefill, against transformers run on the
engine's own outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import (
    SPECIAL_TOKENS,
    hf_logits,
    make_tiny_hf_model,
    prefill_logits,
    save_hf_folder,
    train_qwen_style_tokenizer,
    write_gguf,
)

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.kernels import cpu_fused
from stallfree.engine.model import load_model
from stallfree.engine.model.hf_loader import config_from_hf

TEXT = "Hello, world! def add(a, b): return a + b 🦀 12345"
HEAD_DIM = 32  # hidden 64 / 4 heads = 16: Qwen3 takes head_dim from its config


@pytest.fixture(scope="module")
def qwen_tok():
    return train_qwen_style_tokenizer()


def _qwen3(tok, tie: bool = True):
    endoftext, _, im_end = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    return make_tiny_hf_model(
        "qwen3", tie=tie, vocab_size=tok.get_vocab_size(), head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        bos_token_id=endoftext, eos_token_id=im_end,
    )  # fmt: skip


def _save(folder: Path, hf, tok) -> Path:
    save_hf_folder(folder, hf, tok)
    # Qwen's tokenizer_config.json: no BOS token, <|im_end|> ends a turn.
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": None}))
    return folder


@pytest.mark.parametrize("tie", [True, False])
def test_qwen3_folder_logits_match_transformers(tmp_path: Path, qwen_tok, tie: bool) -> None:
    hf = _qwen3(qwen_tok, tie)
    loaded = load_model(_save(tmp_path, hf, qwen_tok))
    c = loaded.config
    assert c.qk_norm and c.head_dim == HEAD_DIM and c.q_size == 4 * HEAD_DIM and not c.qkv_bias
    assert c.tie_word_embeddings is tie and c.rms_norm_eps == 1e-6
    ids = qwen_tok.encode(TEXT).ids
    ours, ref = prefill_logits(loaded.model, ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4


def test_the_q_k_norms_are_applied(tmp_path: Path, qwen_tok) -> None:
    """Mutant: the same weights with q/k norms set to ones must give other logits (the norms matter)."""
    hf = _qwen3(qwen_tok)
    loaded = load_model(_save(tmp_path, hf, qwen_tok))
    ids = qwen_tok.encode(TEXT).ids
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert (prefill_logits(loaded.model, ids) - ref).abs().max().item() > 1e-2


def test_qwen_style_tokenizer_json(tmp_path: Path, qwen_tok) -> None:
    tok = load_model(_save(tmp_path, _qwen3(qwen_tok), qwen_tok)).tokenizer
    assert tok.encode(TEXT) == qwen_tok.encode(TEXT).ids
    assert tok.decode(tok.encode(TEXT)) == TEXT
    endoftext, im_start, im_end = (qwen_tok.token_to_id(t) for t in SPECIAL_TOKENS)
    assert (tok.bos_token_id, tok.eos_token_id) == (endoftext, im_end)
    assert tok.stop_token_ids >= {endoftext, im_end}
    ids = tok.encode_chat([{"role": "user", "content": "hi 42"}])
    assert ids[0] == im_start and ids.count(im_start) == 2 and ids.count(im_end) == 1
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhi 42<|im_end|>")


def test_qwen3_gguf_matches_transformers(tmp_path: Path, qwen_tok) -> None:
    """A GGUF (arch "qwen3", attn_q_norm / attn_k_norm, key_length 32, pre-tokenizer "qwen2") written by
    the gguf package's writer: same logits as transformers, same tokens as the tokenizer.json."""
    hf = _qwen3(qwen_tok, tie=False)
    endoftext, _, im_end = (qwen_tok.token_to_id(t) for t in SPECIAL_TOKENS)
    path = write_gguf(
        tmp_path / "qwen3.gguf",
        hf,
        qwen_tok,
        arch="qwen3",
        tokenizer_pre="qwen2",
        bos_eos=(endoftext, im_end),
    )
    loaded = load_model(path)
    assert loaded.config.qk_norm and loaded.config.head_dim == HEAD_DIM
    ids = qwen_tok.encode(TEXT).ids
    assert loaded.tokenizer.encode(TEXT) == ids
    assert (prefill_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_qwen3_config_refusals() -> None:
    base = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
    }  # fmt: skip
    assert config_from_hf(base).head_dim == 32
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="unsupported architecture"):
        config_from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"]})


BACKENDS = ["torch", "cpu", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_on_every_backend_matches_transformers(tmp_path: Path, qwen_tok, backend: str) -> None:
    """fp32 engine, chunked prefill (budget 16) beside other requests: each generated token's top-5
    logprobs agree with transformers' on the prompt plus the engine's own tokens (within 1e-4)."""
    if backend == "cpu" and not cpu_fused.available():
        pytest.skip("no C++ compiler here to build the CPU kernels")
    hf = _qwen3(qwen_tok)
    llm = LLM(
        str(_save(tmp_path, hf, qwen_tok)), dtype="float32", device="cpu", attention_backend=backend,
        token_budget=16, num_kv_blocks=64, block_size=16,
    )  # fmt: skip
    assert llm.engine.executor.runner.backend.name == backend
    prompts = [qwen_tok.encode(t).ids for t in (TEXT, "the quick brown fox", TEXT * 2)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        gen = list(out.token_ids)
        assert len(gen) == 5
        ref = torch.log_softmax(hf_logits(hf, prompt + gen), dim=-1)  # (T, vocab)
        for step, lp in enumerate(out.logprobs):
            want = ref[len(prompt) - 1 + step]
            assert int(want.argmax()) == gen[step]
            err = max(abs(v - want[t].item()) for t, v in dict(lp.top).items())
            assert err < 1e-4, f"{backend}: step {step} logprobs differ by {err:.3g}"
