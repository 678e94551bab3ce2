"""An iteration's features: from the scheduler's chunks, and for a hypothetical iteration."""

from __future__ import annotations

import pytest
from costmodel_factories import Chunk

from stallfree.costmodel.features import iteration_features, synthetic_features


def test_features_of_a_hybrid_batch():
    f = iteration_features(
        [Chunk(1, 99, True), Chunk(1, 49, True), Chunk(64, 0, False), Chunk(32, 128, False)]
    )
    assert f["decode_tokens"] == 2
    assert f["decode_attn"] == 100 + 50  # small enough for the cpu backend's paged kernel: no padding
    assert f["prefill_tokens"] == 96
    assert f["prefill_chunks"] == 2
    assert f["prefill_attn"] == pytest.approx(64 * 32.5 + 32 * (128 + 16.5))
    assert f["const"] == 1


def test_decode_attn_pads_each_decode_group_to_its_own_longest():
    # 8 decodes, one a document at 4,000 tokens: too big for the paged kernel (8 x 4000 keys), so the
    # padded groups attend; the chats form their own group (engine.decode_groups)
    f = iteration_features([Chunk(1, 3999, True)] + [Chunk(1, 99, True)] * 6 + [Chunk(1, 79, True)])
    assert f["decode_attn"] == 4000 + 7 * 100


def test_decode_attn_is_unpadded_for_the_paged_kernel():
    f = iteration_features([Chunk(1, 3999, True), Chunk(1, 99, True), Chunk(1, 79, True)])
    assert f["decode_attn"] == 4000 + 100 + 80


def test_synthetic_features_match_the_real_ones():
    s = synthetic_features(64, 3, prefill_context=128, decode_context=20)
    f = iteration_features([Chunk(1, 20, True)] * 3 + [Chunk(64, 128, False)])
    assert s == pytest.approx(f)
