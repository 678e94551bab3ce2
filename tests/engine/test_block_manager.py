from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.engine.block_manager import BlockManager, blocks_needed


def test_allocate_covers_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.allocate("a", 17)
    assert bm.num_blocks_of("a") == 2
    assert bm.allocate("a", 32)  # still two blocks
    assert bm.num_blocks_of("a") == 2
    assert bm.allocate("a", 33)
    assert bm.num_blocks_of("a") == 3
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_no_room_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 8)  # needs 2, only 1 free
    assert bm.num_blocks_of("b") == 0
    assert bm.num_free_blocks == 1
    assert not bm.allocate("a", 16)  # needs 2 more
    assert bm.num_blocks_of("a") == 2
    bm.check_invariants()


def test_bad_sizes_raise_clear_errors():
    import pytest

    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 80), st.booleans()), max_size=60))
def test_blocks_are_conserved(ops):
    bm = BlockManager(num_blocks=16, block_size=8)
    for rid, n, free in ops:
        if free:
            bm.free(rid)
        else:
            before = bm.num_blocks_of(rid)
            ok = bm.allocate(rid, n)
            if ok:
                assert bm.num_blocks_of(rid) >= blocks_needed(n, 8)
            else:
                assert bm.num_blocks_of(rid) == before
        bm.check_invariants()
