"""Grouped decode attention: the grouping rule, and that grouped padded attention is exact.

The attention check compares the torch backend against a float64 softmax over each request's own history,
read key by key from its block table. Padding pages point at block 0, which here holds another request's
keys, so a mask that let padding through would fail the comparison by far more than the tolerance.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stallfree.engine.attention import KVCache, Stager, host_batch
from stallfree.engine.attention.torch_backend import TorchBackend
from stallfree.engine.decode_groups import MIN_GAP, decode_groups, padded_decode_area
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import ScheduledChunk, SchedulerOutput


@given(st.lists(st.integers(1, 5000), max_size=80))
def test_groups_partition_the_decodes_longest_first(lengths):
    groups = decode_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat, reverse=True)
    for g in groups:
        top = lengths[g[0]]
        # nobody inside a group is both under half the group's longest and MIN_GAP shorter
        assert all(not (2 * lengths[i] <= top and top - lengths[i] >= MIN_GAP) for i in g)
    for a, b in zip(groups, groups[1:], strict=False):
        head = lengths[b[0]]  # each later group starts where the split rule says it must
        assert 2 * head <= lengths[a[0]] and lengths[a[0]] - head >= MIN_GAP
    assert sum(lengths) <= padded_decode_area(lengths) <= len(lengths) * max(lengths, default=0)


def test_a_long_document_no_longer_pads_the_chat_decodes():
    lengths = [4000] + [120] * 16 + [60, 70]
    assert [len(g) for g in decode_groups(lengths)] == [1, 18]
    assert padded_decode_area(lengths) == 4000 + 18 * 120
    assert padded_decode_area([100, 50]) == 200  # 50 tokens apart: not worth a group


def _chunk(rid, start, table, decode):
    n = 1 if decode else 7
    return ScheduledChunk(
        request_id=rid, token_ids=(1,) * n, start=start, block_table=tuple(table), is_decode=decode,
        sample=True, traffic_cluster="default", sampling_params=SamplingParams(), num_output_tokens=0,
    )  # fmt: skip


@pytest.mark.parametrize("lengths", [[5, 40, 300, 1000, 17, 2000, 33], [129], [64, 64, 1]])
def test_grouped_decodes_attend_exactly_to_their_own_history(lengths):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    bs, heads, kv_heads, hd = 16, 6, 2, 8
    pages = [-(-n // bs) for n in lengths] + [3]  # plus one prefill chunk of 7 tokens after 30 cached
    num_blocks = sum(pages) + 1
    cache = KVCache(1, num_blocks, bs, kv_heads, hd, torch.float32, torch.device("cpu"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 stays out: it is the padding page
    tables = [[int(free.pop()) for _ in range(p)] for p in pages]
    chunks = [_chunk(f"d{i}", n - 1, tables[i], True) for i, n in enumerate(lengths)]
    chunks.append(_chunk("p", 30, tables[-1], False))
    out = SchedulerOutput(tuple(chunks), (), 64, 7, len(lengths))
    backend = TorchBackend(cache, heads, kv_heads, hd)
    meta = backend.build_metadata(Stager(torch.device("cpu")).stage_batch(host_batch(out, bs)), len(lengths))
    t = len(lengths) + 7
    q, k, v = torch.randn(t, heads, hd), torch.randn(t, kv_heads, hd), torch.randn(t, kv_heads, hd)
    got = backend.bind(meta)(0, q, k, v)

    kf, vf = (x.view(-1, kv_heads, hd).double() for x in (cache.k[0], cache.v[0]))
    for i, n in enumerate(lengths):
        pos = np.arange(n)
        slots = torch.from_numpy(np.asarray(tables[i])[pos // bs] * bs + pos % bs)
        keys = kf[slots].repeat_interleave(heads // kv_heads, dim=1)  # (n, H, hd)
        vals = vf[slots].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys) / hd**0.5
        want = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vals)
        assert torch.allclose(got[i].double(), want, atol=1e-5), f"decode {i} (history {n}) is wrong"
    assert len(meta.decode_groups) == len(decode_groups(lengths))
