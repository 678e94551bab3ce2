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
    assert f["decode_attn"] == 2 * 100  # padded to the longest decode context of their group
    assert f["prefill_tokens"] == 96
    assert f["prefill_chunks"] == 2
    assert f["prefill_attn"] == pytest.approx(64 * 32.5 + 32 * (128 + 16.5))
    assert f["const"] == 1


def test_decode_attn_pads_each_decode_group_to_its_own_longest():
    # a document at 4,000 tokens and two chats: the chats form their own group (engine.decode_groups)
    f = iteration_features([Chunk(1, 3999, True), Chunk(1, 99, True), Chunk(1, 79, True)])
    assert f["decode_attn"] == 4000 + 2 * 100


def test_synthetic_features_match_the_real_ones():
    s = synthetic_features(64, 3, prefill_context=128, decode_context=20)
    f = iteration_features([Chunk(1, 20, True)] * 3 + [Chunk(64, 128, False)])
    assert s == pytest.approx(f)
