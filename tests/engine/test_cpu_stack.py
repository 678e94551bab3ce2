"""The decoder stack in one C++ call (engine/model/cpu_stack.py) computes what the Python fused path does,
bit for bit: same tokens and same logprobs over hybrid iterations (decodes with chunks riding along, a
prefix-cache hit), and the engine really takes it in the default CPU mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import make_llm, prompt_ids

from stallfree.engine import SamplingParams
from stallfree.engine.model.cpu_stack import CpuStack
from stallfree.engine.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(None, dtype=torch.bfloat16, quantization="int4")


def _prompts(model) -> list[list[int]]:
    text = prompt_ids(model.tokenizer, 700)
    # 5 prompts of 4 to ~250 tokens, and the third again (a prefix-cache hit for all but its last block)
    ps = [text[11 * k : 11 * k + 4 + (k * 61) % 250] for k in range(5)]
    return [*ps, ps[2]]


def _run(model, prompts) -> list[tuple[list[int], list[float]]]:
    llm = make_llm(model, token_budget=48, max_num_seqs=8, dtype="bfloat16", quantization="int4")
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in outs]


class _Counting:
    def __init__(self, stack: CpuStack) -> None:
        self.stack, self.calls, self.rows = stack, 0, 0

    def __call__(self, x, positions, rows):
        self.calls += 1
        self.rows += x.shape[0]
        return self.stack(x, positions, rows)


def test_the_stack_gives_the_python_path_bit_for_bit(model, monkeypatch):
    lm = model.model
    assert isinstance(lm.cpu_stack, CpuStack), "the default CPU mode should run its layers in one C++ call"
    prompts = _prompts(model)
    counting = _Counting(lm.cpu_stack)
    monkeypatch.setattr(lm, "cpu_stack", counting)
    fast = _run(model, prompts)
    # the uncached prompts' tokens all went through it (and the decodes)
    assert counting.calls > 0 and counting.rows >= sum(len(p) for p in prompts[:5])
    monkeypatch.setattr(lm, "cpu_stack", None)
    slow = _run(model, prompts)
    assert fast == slow
    assert fast[5] == fast[2]  # and the repeat after its cache hit is the same answer


def test_a_stack_that_differs_is_caught(model, monkeypatch):
    """The comparison above can fail: a stack with another epsilon in its norms changes the answers."""
    prompts = _prompts(model)[:3]
    lm = model.model
    reference = _run(model, prompts)
    monkeypatch.setattr(lm.cpu_stack, "eps", lm.cpu_stack.eps * 100)
    assert _run(model, prompts) != reference


def test_models_the_stack_does_not_cover_keep_the_python_path(model):
    """Per-head q/k norms (Qwen3) are not in the C++ stack; a model with unpacked linears has none either."""
    lm = model.model
    qwen3_like = dataclasses.replace(lm.config, qk_norm=True)
    orig = lm.config
    try:
        lm.config = qwen3_like
        assert CpuStack.of(lm) is None
    finally:
        lm.config = orig
    fp32 = load_model(None, dtype=torch.float32)
    assert fp32.model.cpu_stack is None and CpuStack.of(fp32.model) is None
