"""Same request, same answer in the default CPU mode (bf16 activations, int4 weights, prefix caching on,
the C++ kernels): a prompt's greedy tokens AND their logprobs are bit-identical whether it runs (a) alone,
(b) again after a prefix-cache hit, (c) amid 16 other requests arriving at once, (d) chunked at token
budgets 17 / 64 / 512, (e) over HTTP streamed or not.

Exact equality is the right check here, not a tolerance: the engine promises one arithmetic per row (one
GEMM per weight with a fixed reduction order, one attention kernel for decodes and chunk tokens alike),
so any difference is a broken promise. The mutants (a linear layer or attention that switches path by row
count or row kind, as the engine used to) show the comparison catches the rounding a path switch brings.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import make_llm, prompt_ids

from stallfree.engine import SamplingParams
from stallfree.engine.attention.cpu_backend import CpuBackend
from stallfree.engine.attention.torch_backend import TorchBackend, torch_metadata
from stallfree.engine.model.cpu_linear import PackedLinear
from stallfree.engine.model.loader import load_model

sys.path.insert(0, str(Path(__file__).parent / "server"))
from server_helpers import API_KEY, start_server  # noqa: E402

N_PROMPTS = 52
MAX_TOKENS = 8
DEFAULT_MODE = dict(dtype="bfloat16", quantization="int4")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(
        1
    )  # as the rest of the suite (conftest.default_model); the answers do not depend on it
    return load_model(None, dtype=torch.bfloat16, quantization="int4")


@pytest.fixture(scope="module")
def prompts(model):
    """N_PROMPTS prompts of 3 to ~300 tokens, each starting at another offset (no shared first block, so
    only the deliberate repeats hit the prefix cache)."""
    text = prompt_ids(model.tokenizer, 9 * N_PROMPTS + 320)
    return [text[9 * k : 9 * k + 3 + (k * 37) % 300] for k in range(N_PROMPTS)]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)


def answers(outputs) -> list[tuple[list[int], list[float]]]:
    return [(list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in outputs]


def generate(llm, batch):
    return answers(llm.generate(list(batch), params(), use_tqdm=False))


def assert_identical(got, ref, what):
    bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
    assert not bad, f"{what}: {len(bad)} of {len(ref)} prompts got another answer (first: #{bad[0]})"


@pytest.fixture(scope="module")
def alone_and_cached(model, prompts):
    """(a) each prompt alone in a fresh engine, then (b) each again in the same engine (a cache hit)."""
    llm = make_llm(model, token_budget=512, **DEFAULT_MODE)
    first, again = [], []
    for p in prompts:  # the repeat right after the first run: its blocks are still cached
        first += generate(llm, [p])
        again += llm.generate([p], params(), use_tqdm=False)
    return first, answers(again), [o.num_cached_tokens for o in again]


def test_a_repeated_request_gets_the_same_answer_after_a_cache_hit(prompts, alone_and_cached):
    alone, again, hits = alone_and_cached
    long_ones = [h for p, h in zip(prompts, hits, strict=True) if len(p) > 16]
    assert long_ones and all(h >= 16 for h in long_ones), "the repeats must be served from the prefix cache"
    assert_identical(again, alone, "after a prefix-cache hit")


def test_amid_sixteen_others_arriving_at_once(model, prompts, alone_and_cached):
    alone = alone_and_cached[0]
    llm = make_llm(model, token_budget=512, max_num_seqs=17, **DEFAULT_MODE)
    got: list = [None] * len(prompts)
    for start in range(0, len(prompts), 17):
        idx = [(start + j) % len(prompts) for j in range(17)]  # the last group wraps: always 17 at once
        for i, ans in zip(idx, generate(llm, [prompts[i] for i in idx]), strict=True):
            got[i] = ans
    assert_identical(got, alone, "amid 16 others")


@pytest.mark.parametrize("budget", [17, 64, 512])
def test_chunked_at_any_budget(model, prompts, alone_and_cached, budget):
    llm = make_llm(model, token_budget=budget, max_num_seqs=64, **DEFAULT_MODE)
    assert_identical(generate(llm, prompts), alone_and_cached[0], f"budget {budget}")


def test_streamed_and_not_over_http(model, prompts, alone_and_cached):
    from openai import OpenAI

    alone = alone_and_cached[0]
    server = start_server(model, **DEFAULT_MODE)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        kw = dict(model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
        for k, p in enumerate(prompts):
            plain = client.completions.create(prompt=p, **kw).choices[0]
            chunks = [ch.choices[0] for ch in client.completions.create(prompt=p, stream=True, **kw)]
            streamed = "".join(c.text for c in chunks)
            streamed_lps = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
            want_text = model.tokenizer.decode(alone[k][0])
            assert plain.text == streamed == want_text, f"prompt #{k}: HTTP text differs"
            assert plain.logprobs.token_logprobs == streamed_lps == alone[k][1], f"prompt #{k}: logprobs"
    finally:
        server.stop()


# --- the comparison is sharp -----------------------------------------------------------------------------


def _linear_switching_by_rows(self, x):
    """The old engine's flaw: few rows take another GEMM (here float32 torch on the same weights)."""
    if x.shape[0] <= 4:
        return F.linear(x.float(), self.dequantized(), self.bias).bfloat16()
    return ORIG_FORWARD(self, x)


def _attention_by_row_kind(self, meta, store=True):
    """Decodes through padded SDPA groups and chunks through SDPA, as before the one kernel: the torch
    backend's attention over the cpu backend's cache (the layers keep the C++ kernels)."""
    sdpa = TorchBackend(self.cache, self.num_heads, self.num_kv_heads, self.head_dim)
    return sdpa.bind(torch_metadata(meta.batch, self.cache.block_size), store)


def _no_paged_rows(self, meta):
    """No one-call C++ layer stack: the model runs layer by layer, attending through `bind`."""
    return None


ORIG_FORWARD = PackedLinear.forward


@pytest.mark.parametrize(
    "mutants",
    [
        [(PackedLinear, "forward", _linear_switching_by_rows)],
        [(CpuBackend, "bind", _attention_by_row_kind), (CpuBackend, "paged_rows", _no_paged_rows)],
    ],
    ids=["gemm-path-by-row-count", "attention-path-by-row-kind"],
)
def test_a_path_switch_is_caught(model, prompts, alone_and_cached, monkeypatch, mutants):
    for target, attr, mutant in mutants:
        monkeypatch.setattr(target, attr, mutant)
    llm = make_llm(model, token_budget=64, max_num_seqs=64, **DEFAULT_MODE)
    got = generate(llm, prompts[:12])
    assert got != alone_and_cached[0][:12], "a path switch by row count went unnoticed"
