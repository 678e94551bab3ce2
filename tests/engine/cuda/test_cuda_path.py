"""The CUDA path (CudaModelRunner: fused kernels, Triton paged attention, GPU sampler, CUDA graphs) computes
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


CASES = (
    [("smollm2-135m", torch.bfloat16, 8), ("tiny-hd128", torch.bfloat16, None)]
    if CUDA
    else [("tiny", torch.float32, None)]
)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def case(request):
    shape, dtype, layers = request.param
    return _model(shape, dtype, layers), dtype


def _llm(loaded: LoadedModel, dtype: torch.dtype, backend: str, budget: int, **kw) -> LLM:
    loaded.model.fused_kernels = False  # each engine sets what its runner needs
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
        assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
        a, b = _run(graphs, prompts, 12), _run(eager, prompts, 12)
        if n in (1, 4):  # same kernels, same shapes: bit-identical
            assert [o.token_ids for o in a] == [o.token_ids for o in b]
            assert [o.logprobs[-1].logprob for o in a] == [o.logprobs[-1].logprob for o in b]
        else:
            _compare(b, a, dtype, f"graphs vs eager, {n} decodes")


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_fp16_and_fp32_work_on_cuda(dtype):
    loaded = _model("tiny-hd128", dtype)
    prompts = _prompts(loaded.config.vocab_size, [9, 150])
    ref = _run(_llm(loaded, dtype, "torch", 4096), prompts)
    auto = _llm(loaded, dtype, "auto", 64)
    want = "torch" if dtype == torch.float32 else "triton"
    assert auto.engine.runner.attention.name == want
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
