"""Helpers for the CUDA-path tests (tests/engine/cuda): random-weight models, engines, comparisons."""

from __future__ import annotations

import torch

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.dummy import build_dummy_model, dummy_config, synthetic_tokenizer
from stallfree.engine.model.loader import LoadedModel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LP_TOL = {torch.float32: 2e-4, torch.bfloat16: 0.15, torch.float16: 0.03}
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.05}

TINY = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _model(shape: str, dtype: torch.dtype, layers: int | None = None) -> LoadedModel:
    config = TINY if shape == "tiny" else dummy_config(shape, max_model_len=2048)
    if layers is not None:
        from dataclasses import replace

        config = replace(config, num_layers=layers)
    model = build_dummy_model(config, dtype, DEVICE, seed=0)
    return LoadedModel(model, synthetic_tokenizer(config.vocab_size), config, f"dummy-{shape}")


def _llm(loaded: LoadedModel, dtype: torch.dtype, backend: str, budget: int, **kw) -> LLM:
    return LLM(
        loaded_model=loaded, attention_backend=backend, token_budget=budget, device=DEVICE,
        dtype=str(dtype).removeprefix("torch."), num_kv_blocks=kw.pop("num_kv_blocks", 256),
        max_num_seqs=kw.pop("max_num_seqs", 16), **kw,
    )  # fmt: skip


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[(97 * i + 31 * k) % (vocab - 3) + 3 for i in range(n)] for k, n in enumerate(lengths)]


def _run(llm: LLM, prompts, max_tokens: int = 6):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=20, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def _compare(ref, got, dtype, what: str) -> None:
    """First-token top-20 logprobs within LP_TOL; greedy outputs equal up to a first divergence at a near-tie."""
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        ra = dict(a.logprobs[0].top)
        rb = dict(b.logprobs[0].top)
        common = [t for t in ra if t in rb][:10]
        assert len(common) >= 5, f"{what}, prompt {i}: top-20 sets barely overlap"
        err = max(abs(ra[t] - rb[t]) for t in common)
        assert err < LP_TOL[dtype], f"{what}, prompt {i}: first-token logprobs differ by {err:.3g}"
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                top = dict(a.logprobs[j].top)
                gap = abs(top[ta] - top.get(tb, -1e9))
                assert gap < NEAR_TIE[dtype], (
                    f"{what}, prompt {i}: greedy diverges at token {j} ({ta} vs {tb}) with a logprob gap of "
                    f"{gap:.3g}, not a near-tie"
                )
                break
