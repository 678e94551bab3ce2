"""CPU compact weights (engine/model/cpu_linear.py): the kernels compute what their weights say, and chunked
prefill matches one-shot prefill in each mode: exactly, since every row count runs through the one GEMM
and every row through the one attention kernel (tests/engine/test_same_answer.py holds the whole engine to
that). ATOL is the scale for the mutant: positions restarted per chunk move the first token's logits
(O(10-40)) by ~26 in bf16, far beyond bf16's own step there (0.125 at 16-32).
"""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import first_logits_and_greedy, prompt_ids

import stallfree.engine.model_runner as runner_mod
from stallfree.engine.kernels import cpu_fused
from stallfree.engine.model.cpu_linear import KIND, PackedLinear, quantize_int4
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


# K = 128: two blocks of 2 groups; 576 (the default model's hidden size): two blocks of 8 groups and one of
# 2; 96: padded to 128 with a zero group.
@pytest.mark.parametrize("k", [128, 576, 96])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_packed_linear_matches_its_weights_for_every_row_count(quantization, k):
    """One row at a time, 16 at once and 37 at once all compute x W_q^T, W_q the quantized W (int4 / int8:
    with the activations quantized to int8 per group of 32, hence the tolerance), and give each row the
    same bits (same request, same answer)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, k, generator=g) * 0.05
    x = torch.randn(37, k, generator=g).bfloat16()
    lin = PackedLinear(w, None, quantization)
    ref = x.float() @ lin.dequantized().T  # (37, 96)
    many = lin(x)
    few = torch.cat([lin(x[i : i + 1]) for i in range(37)])
    sixteen = torch.cat([lin(x[:16]), lin(x[16:32]), lin(x[32:])])
    assert torch.equal(many, few) and torch.equal(many, sixteen), "a row's result depends on its batch"
    scale_out = ref.abs().max().item()
    err = (many.float() - ref).abs().max().item() / scale_out
    assert err < 1e-2, f"{quantization}: relative error {err:.3g}"
    if quantization != "none":  # the quantization is real: the fp32 weight gives a visibly different answer
        assert ((x.float() @ w.T) - ref).abs().max().item() / scale_out > 1e-3
    if quantization == "int4":  # and it is the Q4_1 grid: codes 0..15 times a step plus a min per 32
        codes, scale, zero = quantize_int4(w)
        grid = (codes.view(96, k // 32, 32) * scale[..., None] + (zero - 8 * scale)[..., None]).view(96, k)
        torch.testing.assert_close(lin.dequantized(), grid, rtol=0, atol=1e-6)


needs_kernels = pytest.mark.skipif(
    not cpu_fused.available(), reason="no C++ compiler here for the CPU kernels"
)


@needs_kernels
@pytest.mark.parametrize("k", [128, 576, 96, 1536])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_integer_gemm_is_its_scalar_reference_bit_for_bit(quantization, k):
    """The vector path (AVX512-VNNI where the CPU has it) and the one-lane-at-a-time reference, which is
    also the path of CPUs without it, do the same operations in the same order: the same bits, bias
    included."""
    ops = cpu_fused.load()
    g = torch.Generator().manual_seed(2)
    lin = PackedLinear(torch.randn(64, k, generator=g) * 0.05, torch.randn(64, generator=g), quantization)
    for rows in (1, 5, 37):
        x = torch.randn(rows, k, generator=g).bfloat16()
        args = (KIND[quantization], lin.packed, lin.scale, lin.minv, lin.bias, 64)
        assert torch.equal(ops.packed_linear(x, *args), ops.packed_linear_scalar(x, *args)), (rows, k)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_integer_gemm_exact_at_the_extreme_codes(bits):
    """The largest codes times the largest quantized activations (|xq| = 127 everywhere), where an int16
    partial sum would overflow first (AVX2 sums pairs in int16), and random codes over the kind's whole range
    (int8: 0..255, though the quantizer stores 1..255): the vector path is still its reference, and with
    every code and activation equal the output is the exact product."""
    ops = cpu_fused.load()
    g = torch.Generator().manual_seed(4)
    n, k, top = 16, 1600, 2**bits - 1  # 1600: six blocks of 8 groups and a block of 2
    kind = 0 if bits == 4 else 1
    for codes in (
        torch.full((n, k), top, dtype=torch.uint8),
        torch.randint(0, top + 1, (n, k), generator=g).to(torch.uint8),
    ):
        packed = ops.pack_weights(codes, bits)
        groups = (k + 63) // 64 * 2
        scale = torch.full((n, groups) if bits == 4 else (n,), 0.5)
        minv = torch.zeros_like(scale)
        for value in (1.0, -1.0):
            x = torch.full((3, k), value).bfloat16()
            out = ops.packed_linear(x, kind, packed, scale, minv, None, n)
            assert torch.equal(out, ops.packed_linear_scalar(x, kind, packed, scale, minv, None, n))
            if codes.min() == top:  # every product is top x 0.5 x value: the sum exact in float32, then bf16
                assert torch.equal(out, torch.full((3, n), top * 0.5 * value * k).bfloat16())
        x = torch.randn(5, k, generator=g).bfloat16()
        assert torch.equal(
            ops.packed_linear(x, kind, packed, scale, minv, None, n),
            ops.packed_linear_scalar(x, kind, packed, scale, minv, None, n),
        )


@needs_kernels
def test_a_vector_capable_cpu_gets_the_vector_gemm():
    """A CPU with AVX2 must not fall back to the one-lane reference for int4/int8 (it silently did on
    AVX2-only machines, 8-50x slower): the build reports the path it took."""
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = cpu_fused.load().kernel_isa()
    if "avx512_vnni" in flags and "avx512bw" in flags:
        assert "int4/int8: avx512-vnni" in isa
    elif "avx2" in flags and "fma" in flags:
        assert "int4/int8: avx2" in isa and "attention: avx2" in isa
    else:
        pytest.skip(f"no AVX2 here: {isa}")


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_lane_order_packing_round_trips(bits):
    ops = cpu_fused.load()
    g = torch.Generator().manual_seed(3)
    for k in (64, 96, 256, 576, 1536):
        codes = torch.randint(0, 2**bits, (8, k), generator=g).to(torch.uint8)
        packed = ops.pack_weights(codes, bits)
        assert packed.shape == (8, (k + 63) // 64 * 64 * bits // 8)
        assert torch.equal(ops.unpack_weights(packed, bits, k), codes), k
    with pytest.raises(RuntimeError, match="0..15"):
        ops.pack_weights(torch.full((1, 64), 16, dtype=torch.uint8), 4)


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
            assert torch.equal(logits, ref_logits), f"{quantization}: prompt {n}, budget {budget}: {diff}"
            assert tokens == ref_tokens, f"{quantization}: prompt {n}, budget {budget}: greedy changed"


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
