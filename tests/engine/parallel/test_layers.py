"""Tensor-parallel slicing and pipeline stages in one process, on tiny random Llama models.

With the identity in place of the all-reduce, each rank's row-parallel output is a partial sum: summing
the ranks' outputs must give the full layer's output; the vocabulary shards of the logits, concatenated,
must give the full logits; the pipeline stages chained must give the full model. fp32, ATOL 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.parallel.layers import head_shard
from stallfree.engine.parallel.stage import build_stage, stage_layers

ATOL = 1e-5


def tiny(
    num_heads, num_kv_heads, vocab=50, tied=False, bias=False, layers=2, qk_norm=False
) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=num_heads * 4, intermediate_size=22, num_layers=layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=4, max_position_embeddings=64,
        tie_word_embeddings=tied, qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def causal(layer, q, k, v):
    """Exact attention over one sequence; query head h reads KV head h // group (no cache)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


def shards(model, tp):
    state = model.state_dict()
    return [build_stage(model.config, state, tp_size=tp, tp_rank=r, pp_size=1, stage=0) for r in range(tp)]


@pytest.mark.parametrize(
    "nh, nkv, tp",
    [(6, 2, 2), (9, 3, 2), (8, 2, 4), (9, 3, 4), (4, 4, 3), (6, 1, 3)],
    ids=["even", "uneven-groups", "kv-replicated", "kv-replicated-uneven", "mha-3", "mqa-3"],
)
@pytest.mark.parametrize(("bias", "qk_norm"), [(False, False), (True, False), (False, True)])
def test_rank_partial_sums_equal_the_full_layers(nh, nkv, tp, bias, qk_norm):
    model = tiny(nh, nkv, bias=bias, qk_norm=qk_norm)  # qk_norm: Qwen3's per-head q/k norms (replicated)
    ranks = shards(model, tp)
    x = torch.randn(7, model.config.hidden_size)
    pos = torch.arange(7)
    cos, sin = model.rotary(pos)
    for i, full in enumerate(model.model.layers):
        want = full.self_attn(x, cos, sin, causal)
        got = sum(r.model.layers[i].self_attn(x, cos, sin, causal) for r in ranks)
        if bias:  # every rank adds the o_proj bias after its (identity) all-reduce: count it once
            got = got - (tp - 1) * full.self_attn.o_proj.bias
        assert (got - want).abs().max() < ATOL
        want = full.mlp(x)
        assert (sum(r.model.layers[i].mlp(x) for r in ranks) - want).abs().max() < ATOL


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_embedding_and_logits(tied, tp):
    model = tiny(6, 2, vocab=50, tied=tied)  # 50 is not a multiple of 3: the last shard is padded
    ranks = shards(model, tp)
    ids = torch.tensor([0, 1, 16, 17, 33, 34, 49])
    want = model.model.embed_tokens(ids)
    assert (sum(r.model.embed_tokens(ids) for r in ranks) - want).abs().max() < ATOL
    h = torch.randn(3, model.config.hidden_size)
    # each rank's logits are its vocabulary rows (the all-gather is the identity here)
    got = torch.cat([r.compute_logits(h) for r in ranks], dim=-1)[:, :50]
    assert (got - model.compute_logits(h)).abs().max() < ATOL


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_stages_chained_equal_the_full_model(pp):
    model = tiny(6, 2, layers=5, tied=True)
    state = model.state_dict()
    stages = [build_stage(model.config, state, tp_size=1, tp_rank=0, pp_size=pp, stage=s) for s in range(pp)]
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6)
    x = ids
    for st in stages:
        x = st(x, pos, causal)
    assert (x - model(ids, pos, causal)).abs().max() < ATOL
    assert [st.layer_range for st in stages] == [stage_layers(5, pp, s) for s in range(pp)]
    assert [(st.first_stage, st.last_stage) for st in stages] == [(s == 0, s == pp - 1) for s in range(pp)]


def test_head_assignment():
    # SmolLM2: 3 KV groups of 3 query heads on 2 ranks are split 1 + 2 groups.
    assert head_shard(9, 3, 2, 0).q_heads == (0, 1, 2) and head_shard(9, 3, 2, 1).kv_heads == (1, 2)
    # 2 KV heads on 4 ranks: each KV head replicated on 2 ranks, its 4 query heads split 2 + 2.
    assert [head_shard(8, 2, 4, r) for r in range(4)][1].q_heads == (2, 3)
    assert [head_shard(8, 2, 4, r).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ValueError, match="too large"):
        head_shard(2, 1, 4, 0)
    with pytest.raises(ValueError, match="exceeds"):
        stage_layers(2, 3, 0)
