"""The C++ CPU kernels (engine/kernels/cpu_kernels.cpp, built by cpu_fused.load) against their references,
and the `cpu` attention backend against the plain-torch one on the real model.

Each kernel computes in fp32 and rounds once per stored value, as its reference does, so bf16 and fp16
results must match the reference exactly except where the two sum in a different order (RMSNorm's mean,
the attention's dot products): there, fp32 within 1e-5 relative, and low precision within one rounding.
The backend comparison runs the fp32 model under both backends through decodes of different lengths,
chunked prefills riding with decodes, and both of the cpu backend's decode paths (paged kernel and padded
groups); its mutant (a decode's history one token short) shows the comparison is sharp.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import LogitRecorder, make_llm, prompt_ids

import stallfree.engine.attention.cpu_backend as cpu_backend_mod
from stallfree.engine import SamplingParams
from stallfree.engine.attention import resolve_attention_backend
from stallfree.engine.kernels import cpu_fused as K

pytestmark = pytest.mark.skipif(not K.available(), reason="no C++ compiler here to build the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one rounding apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 2**-10,
                                   atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype) if with_residual else None
    w = torch.randn(576, generator=g).to(dtype)
    out, new_res = K.add_rmsnorm(x, res, w, 1e-5)
    ref_out, ref_res = K.add_rmsnorm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the sum is rounded once, in both
    _close(out, ref_out, dtype)
    assert new_res.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    _close(K.silu_and_mul(x), K.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_views_of_a_fused_projection(dtype):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    mine = qkv.clone()
    pos = torch.tensor([0, 1, 15, 16, 700, 2047])
    cos, sin = torch.randn(2048, 32, generator=g), torch.randn(2048, 32, generator=g)
    q, k = mine[:, :576].view(6, 9, 64), mine[:, 576:768].view(6, 3, 64)
    K.rope_(q, k, pos, cos, sin)
    K.rope_ref(qkv[:, :576].view(6, 9, 64), qkv[:, 576:768].view(6, 3, 64), pos, cos, sin)
    _close(mine, qkv, dtype)  # v (the last third) untouched by both
    with pytest.raises(RuntimeError, match="outside the RoPE tables"):
        K.rope_(q, k, torch.tensor([0, 1, 2, 3, 4, 2048]), cos, sin)


def test_store_kv_skips_padding_and_refuses_bad_slots():
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 2 * 3 * 64, generator=g).bfloat16()
    k, v = kv[:, :192].view(4, 3, 64), kv[:, 192:].view(4, 3, 64)
    caches = [torch.zeros(64, 3, 64, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([5, -1, 63, 0])
    K.store_kv(k, v, caches[0], caches[1], slots)
    K.store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        K.store_kv(k, v, caches[0], caches[1], torch.tensor([5, 1, 64, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 2, 48)])
def test_paged_decode_attention(dtype, heads, kv_heads, head_dim):
    """Lengths of 1, within a page, on a page boundary and many pages; pages in any order; the unused
    pages after a decode's last one (and the unused tail of its last page) are never read."""
    g = torch.Generator().manual_seed(4)
    blocks, bs = 64, 16
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 16, 17, 300], dtype=torch.int32)
    tables = torch.zeros(5, 20, dtype=torch.int32)
    perm = torch.randperm(blocks, generator=g)[1:].to(torch.int32)  # block 0 stays poisoned below
    used = 0
    for d, n in enumerate(lens.tolist()):
        pages = -(-n // bs)
        tables[d, :pages] = perm[used : used + pages]
        used += pages
        if n % bs:  # poison the last page's unused tail
            k_cache[tables[d, pages - 1], n % bs :] = float("nan")
            v_cache[tables[d, pages - 1], n % bs :] = float("nan")
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # the padding entries of every table
    q = torch.randn(5, heads, head_dim, generator=g).to(dtype)
    got = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert torch.isfinite(got.float()).all()
    _close(got, K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 2, 48)])
def test_chunk_rows_match_each_row_alone(dtype, heads, kv_heads, head_dim):
    """A prefill chunk's rows (one table, lengths rising by one) are computed in groups that share each key
    and value as it is widened; every row must still come out bit-identical to the same row sent alone,
    beside an unrelated decode or in another order, and within rounding of the reference. Past the chunk's
    last key the cache is poisoned, so a row that read a key it must not see would turn NaN."""
    g = torch.Generator().manual_seed(7)
    blocks, bs, n, ctx = 48, 16, 37, 213  # 37 rows: groups of the kernel's size and a ragged last group
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    pages = -(-ctx // bs)
    table = torch.randperm(blocks - 1, generator=g)[:pages].to(torch.int32) + 1
    k_cache[table[-1], ctx % bs :], v_cache[table[-1], ctx % bs :] = float("nan"), float("nan")
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # the table's padding entries
    width = pages + 2
    tables = torch.zeros(n, width, dtype=torch.int32)
    tables[:, :pages] = table
    lens = torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int32)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    chunk = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert torch.isfinite(chunk.float()).all()
    for i in range(n):
        alone = K.paged_decode_attention(
            q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], scale
        )
        assert torch.equal(alone[0], chunk[i]), f"row {i} differs when computed alone"
    # The same rows reversed (no two neighbours share a length order) and after an unrelated decode.
    rev = K.paged_decode_attention(q.flip(0), k_cache, v_cache, tables.flip(0), lens.flip(0), scale)
    assert torch.equal(rev.flip(0), chunk)
    other = torch.zeros(1, width, dtype=torch.int32)
    other[0, :2] = table[:2]
    mixed = K.paged_decode_attention(torch.cat([q[:1], q]), k_cache, v_cache, torch.cat([other, tables]),
                                     torch.cat([torch.tensor([20], dtype=torch.int32), lens]), scale)  # fmt: skip
    assert torch.equal(mixed[1:], chunk)
    _close(chunk, K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale), dtype)


def test_paged_decode_attention_refuses_bad_tables():
    k_cache = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="does not fit"):
        K.paged_decode_attention(q, k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
                                 torch.tensor([17], dtype=torch.int32), 0.125)  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the cache"):
        K.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[4]], dtype=torch.int32),
                                 torch.tensor([3], dtype=torch.int32), 0.125)  # fmt: skip


def test_auto_picks_the_cpu_kernels_and_falls_back_without_them(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="needs the CPU"):
        resolve_attention_backend("cpu", torch.device("cuda"), torch.bfloat16)
    K.available.cache_clear()
    monkeypatch.setattr(K, "load", lambda: (_ for _ in ()).throw(RuntimeError("no compiler")))
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend("auto", cpu, torch.float32) == "torch"
    assert "not available" in caplog.text and "no compiler" in caplog.text
    K.available.cache_clear()


# --- the backend on the real model -----------------------------------------------------------------------


def _run(loaded, backend, prompts, monkeypatch=None, mutate=False):
    """First-step logits of every sampled row, and the greedy outputs, for prompts of different lengths
    arriving together under a small budget: decodes of unequal histories ride with prefill chunks."""
    llm = make_llm(loaded, token_budget=48, attention_backend=backend)
    assert llm.engine.executor.runner.backend.name == backend
    if mutate:
        orig = cpu_backend_mod.cpu_metadata

        def short(*a, **kw):
            meta = orig(*a, **kw)
            meta.lens.sub_(1).clamp_(min=1)
            return meta

        monkeypatch.setattr(cpu_backend_mod, "cpu_metadata", short)  # what the backend calls
    rec = LogitRecorder(llm.engine.executor.runner.model)
    llm.engine.executor.runner.model = rec
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    return torch.cat(rec.logits), [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(default_model):
    return [prompt_ids(default_model.tokenizer, n) for n in (5, 40, 130, 9)]


def test_cpu_backend_matches_torch_backend(default_model, prompts, monkeypatch):
    """Every row (decodes and chunk tokens) through the paged kernel against SDPA's spans and groups."""
    ref_logits, ref_tokens = _run(default_model, "torch", prompts)
    logits, tokens = _run(default_model, "cpu", prompts, monkeypatch)
    assert logits.shape == ref_logits.shape
    diff = (logits - ref_logits).abs().max().item()
    assert diff < 2e-3, f"logits differ by {diff}"
    assert tokens == ref_tokens


def test_a_short_history_is_caught(default_model, prompts, monkeypatch):
    ref_logits, _ = _run(default_model, "torch", prompts)
    logits, _ = _run(default_model, "cpu", prompts, monkeypatch, mutate=True)
    assert (logits - ref_logits).abs().max().item() > 0.5
