"""The CUDA path (the runner with the triton backend: fused kernels, Triton paged attention, GPU sampler, CUDA graphs) computes
what the torch reference backend computes.

On a CUDA machine these run on the GPU in bfloat16 (and fp16, fp32) on random-weight models of the
SmolLM2-135M shape (head_dim 64, GQA 3) and of the 8B's head geometry (`tiny-hd128`: head_dim 128, GQA 4).
Without a GPU the same engine code runs on CPU tensors in fp32 through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET), on a tiny model: that checks the layout, staging, attention
binding and sampling logic here, and the kernels' arithmetic is checked on the GPU.

Tolerances: logprobs of the first generated token (top 20) agree within LP_TOL[dtype] (random weights give
flat distributions, so greedy near-ties are common: where greedy outputs differ, the first divergence must
be at a near-tie, i.e. the two candidates' logprobs within NEAR_TIE[dtype] of each other).
"""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import CUDA, _compare, _llm, _model, _prompts, _run

CASES = (
    [("smollm2-135m", torch.bfloat16, 8), ("tiny-hd128", torch.bfloat16, None)]
    if CUDA
    else [("tiny", torch.float32, None)]
)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def case(request):
    shape, dtype, layers = request.param
    return _model(shape, dtype, layers), dtype


def test_triton_backend_matches_the_torch_backend_one_shot_and_chunked(case):
    loaded, dtype = case
    prompts = _prompts(loaded.config.vocab_size, [5, 40, 130] if not CUDA else [5, 40, 700])
    ref = _run(_llm(loaded, dtype, "torch", 4096), prompts)
    budgets = [64, 512, 4096] if CUDA else [16, 4096]
    for budget in budgets:
        got = _run(_llm(loaded, dtype, "triton", budget), prompts)
        _compare(ref, got, dtype, f"triton, budget {budget}")


def test_mixed_decode_and_prefill_batches_give_each_request_its_solo_output(case):
    loaded, dtype = case
    prompts = _prompts(loaded.config.vocab_size, [33, 7, 90, 18])
    llm = _llm(loaded, dtype, "triton", 48)
    solo = [_run(llm, [p])[0] for p in prompts]
    together = _run(llm, prompts)  # hybrid iterations: decodes riding chunks of the longer prompts
    _compare(solo, together, dtype, "batched vs solo")


def test_preemption_and_resume_keep_the_outputs(case):
    loaded, dtype = case
    prompts = _prompts(loaded.config.vocab_size, [60, 50, 70, 40])
    roomy = _run(_llm(loaded, dtype, "triton", 64), prompts, max_tokens=20)
    tight_llm = _llm(loaded, dtype, "triton", 64, num_kv_blocks=14)
    tight = _run(tight_llm, prompts, max_tokens=20)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    _compare(roomy, tight, dtype, "preempted vs roomy")
    assert tight_llm.engine.block_manager.num_free_blocks == 14


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_outputs_of_eager_decodes(case):
    loaded, dtype = case
    # 3 and 5 decodes are not captured sizes: they replay the graphs of 4 and 8 with padding rows.
    for n in (1, 3, 4, 5):
        prompts = _prompts(loaded.config.vocab_size, [20 + 7 * k for k in range(n)])
        graphs = _llm(loaded, dtype, "triton", 4096)
        eager = _llm(loaded, dtype, "triton", 4096, enforce_eager=True)
        assert (
            graphs.engine.executor.runner.graphs is not None and eager.engine.executor.runner.graphs is None
        )
        a, b = _run(graphs, prompts, 12), _run(eager, prompts, 12)
        assert (
            graphs.engine.executor.runner.piecewise is not None
            and graphs.engine.executor.runner.piecewise.graphs
        )
        if n in (1, 4):  # same kernels, same shapes: bit-identical
            assert [o.token_ids for o in a] == [o.token_ids for o in b]
            assert [o.logprobs[-1].logprob for o in a] == [o.logprobs[-1].logprob for o in b]
        else:
            _compare(b, a, dtype, f"graphs vs eager, {n} decodes")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_piecewise_graphs_give_the_outputs_of_eager_hybrid_iterations(case):
    loaded, dtype = case
    prompts = _prompts(loaded.config.vocab_size, [300, 7, 90, 18, 45])
    # budget 100: decodes ride 100-token chunks of the longer prompts, padded to 128-token graphs
    pieces = _run(_llm(loaded, dtype, "triton", 100), prompts, 10)
    eager = _run(_llm(loaded, dtype, "triton", 100, enforce_eager=True), prompts, 10)
    _compare(eager, pieces, dtype, "piecewise graphs vs eager")


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fp16_and_fp32_work_on_cuda(dtype):
    loaded = _model("tiny-hd128", dtype)
    prompts = _prompts(loaded.config.vocab_size, [9, 150])
    ref = _run(_llm(loaded, dtype, "torch", 4096), prompts)
    auto = _llm(loaded, dtype, "auto", 64)
    want = "torch" if dtype == torch.float32 else "triton"
    assert auto.engine.executor.runner.backend.name == want
    _compare(ref, _run(auto, prompts), dtype, f"auto ({want}) {dtype}")
    if dtype == torch.float32:
        _compare(ref, _run(_llm(loaded, dtype, "triton", 64), prompts), dtype, "triton fp32")


def _flashinfer_ready() -> bool:
    if not CUDA:
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _flashinfer_ready(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_flashinfer_backend_matches_the_torch_backend(dtype):
    # tiny-hd128: the 8B's head geometry, so the JIT modules the 8B benchmark needs are the same ones.
    loaded = _model("tiny-hd128", dtype)
    prompts = _prompts(loaded.config.vocab_size, [5, 40, 700])
    ref = _run(_llm(loaded, dtype, "torch", 4096), prompts)
    for budget in (64, 512, 4096):
        _compare(ref, _run(_llm(loaded, dtype, "flashinfer", budget), prompts), dtype, f"flashinfer {budget}")
