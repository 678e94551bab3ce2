"""Helpers for engine tests on the real default model (CPU, fp32)."""

from __future__ import annotations

import torch

from stallfree.engine import LLM, SamplingParams

TEXT = (
    "Sarathi-Serve splits long prompts into chunks so that decodes keep flowing. "
    "The quick brown fox jumps over the lazy dog while 42 engineers measure latency in Zürich. "
    "def add(a, b):\n    return a + b\n"
    "Paged attention stores keys and values in fixed-size blocks; a block table maps positions to slots. "
)


def prompt_ids(tokenizer, n: int) -> list[int]:
    """The first n token ids of a long varied text."""
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids += tokenizer.encode(f"[{k}] " + TEXT, add_special_tokens=False)
        k += 1
    return ids[:n]


class LogitRecorder:
    """Stands in for the model inside a runner and keeps every compute_logits result."""

    def __init__(self, model):
        self.model = model
        self.logits: list[torch.Tensor] = []

    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    def compute_logits(self, hidden):
        out = self.model.compute_logits(hidden)
        self.logits.append(out.detach().clone())
        return out


def make_llm(loaded, policy="sarathi", token_budget=4096, num_kv_blocks=200, **kw) -> LLM:
    return LLM(
        loaded_model=loaded,
        policy=policy,
        token_budget=token_budget,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=kw.pop("max_num_seqs", 16),
        **kw,
    )


def first_logits_and_greedy(loaded, ids, max_tokens=6, **kw):
    """Run one prompt greedily; return (logits of the first generated token (V,), output token ids)."""
    llm = make_llm(loaded, **kw)
    rec = LogitRecorder(llm.engine.executor.runner.model)
    llm.engine.executor.runner.model = rec
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    return rec.logits[0][0], out.token_ids


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
