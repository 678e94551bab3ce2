"""CPU compact weights (engine/model/cpu_linear.py): the kernels compute what their weights say, and chunked
prefill still matches one-shot prefill within each mode's tolerance.

Tolerances are per mode because bf16 activations round every layer's output to 8 bits of mantissa, and
a chunk of a few rows runs through a different kernel (the weight-only one) than a chunk of hundreds
(oneDNN's bf16 matmul): measured chunked-vs-one-shot differences of the first token's logits (O(10-40))
were at most 0.57 (bf16, prompts of 17-1000 tokens, budgets 16-512; the logits themselves come out of a
bf16 matmul, a step of 0.125 at 16-32); ATOL leaves ~2x headroom. The mutant (positions restarted per
chunk) moves them by ~26, so the comparison is still sharp in bf16. Greedy tokens may flip only on a near
tie: where the argmax differs, the reference's top two must be within ATOL of each other.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_helpers import first_logits_and_greedy, prompt_ids

import stallfree.engine.model_runner as runner_mod
from stallfree.engine.model.cpu_linear import PackedLinear, quantize_int4, quantize_int8
from stallfree.engine.model.loader import load_model

ATOL = {"none": 1.0, "int4": 1.0}


def test_int4_recovers_q4_1_blocks():
    """A Q4_1 block (min m, step d, codes 0..15 with both ends used) comes back with the same codes."""
    g = torch.Generator().manual_seed(0)
    n, k = 8, 64
    codes = torch.randint(0, 16, (n, k), generator=g)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15  # llama.cpp's quantizer: the block's min has code 0 and its max code 15
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = (codes.view(n, -1, 32) * d[..., None] + m[..., None]).view(n, k)
    got, scale, zero = quantize_int4(w)
    assert torch.equal(got, codes.to(torch.int32))
    torch.testing.assert_close(scale, d, rtol=1e-5, atol=0)
    torch.testing.assert_close(zero, m + 8 * d, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_packed_linear_matches_its_weights_on_both_paths(quantization):
    """Few rows (weight-only kernel) and many rows (oneDNN bf16) both compute x W_q^T, W_q the quantized W."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g) * 0.05
    x = torch.randn(16, 128, generator=g).bfloat16()
    if quantization == "int4":
        codes, scale, zero = quantize_int4(w)
        wq = (codes.view(96, 4, 32) - 8) * scale.bfloat16().float()[..., None] + zero.bfloat16().float()[
            ..., None
        ]
        wq = wq.view(96, 128)
    elif quantization == "int8":
        codes8, s8 = quantize_int8(w)
        wq = codes8.float() * s8.bfloat16().float()[:, None]
    else:
        wq = w
    ref = x.float() @ wq.T  # (16, 96)
    lin = PackedLinear(w, None, quantization)
    many = lin(x).float()
    few = torch.cat([lin(x[i : i + 1]) for i in range(16)]).float()
    scale_out = ref.abs().max().item()
    for name, out in (("many rows", many), ("one row", few)):
        err = (out - ref).abs().max().item() / scale_out
        assert err < 1e-2, f"{quantization}, {name}: relative error {err:.3g}"
    if quantization != "none":  # the quantization is real: the fp32 weight gives a visibly different answer
        assert ((x.float() @ w.T) - ref).abs().max().item() / scale_out > 1e-3


@pytest.fixture(scope="module", params=["none", "int4"])
def mode_model(request):
    return request.param, load_model(None, dtype=torch.bfloat16, quantization=request.param)


def _first(loaded, ids, **kw):
    return first_logits_and_greedy(loaded, ids, dtype="bfloat16", **kw)


def test_chunked_matches_one_shot_in_each_mode(mode_model):
    quantization, loaded = mode_model
    for n in (17, 300):
        ids = prompt_ids(loaded.tokenizer, n)
        ref_logits, ref_tokens = _first(loaded, ids)
        for budget in (16, 64, 257):
            if budget >= n:
                continue
            logits, tokens = _first(loaded, ids, token_budget=budget)
            diff = (logits - ref_logits).abs().max().item()
            assert diff < ATOL[quantization], (
                f"{quantization}: prompt {n}, budget {budget}: logits differ by {diff}"
            )
            if tokens[0] != ref_tokens[0]:
                top2 = torch.topk(ref_logits, 2).values
                assert (top2[0] - top2[1]).item() < ATOL[quantization], (
                    f"{quantization}: prompt {n}, budget {budget}: greedy changed"
                )


def test_restarted_positions_are_caught_in_each_mode(mode_model, monkeypatch):
    quantization, loaded = mode_model
    ids = prompt_ids(loaded.tokenizer, 300)
    ref_logits, _ = _first(loaded, ids)
    orig = runner_mod.host_batch

    def restart(out, block_size):
        hb = orig(out, block_size)
        starts = np.concatenate([np.full(c.num_tokens, c.start) for c in out.chunks])
        return replace(hb, positions=hb.positions - starts)

    monkeypatch.setattr(runner_mod, "host_batch", restart)
    logits, _ = _first(loaded, ids, token_budget=64)
    assert (logits - ref_logits).abs().max().item() > 10 * ATOL[quantization]
