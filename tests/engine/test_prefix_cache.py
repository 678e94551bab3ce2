"""Prefix cache in the block manager: sharing, reference counts, LRU eviction, hashing (no torch)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.engine.block_manager import BlockManager, block_hash, root_hash


def tok(ids):
    return lambda a, b: ids[a:b]


def cached_bm(num_blocks: int = 16, block_size: int = 4, salt: str = "") -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True, salt=salt)


def admit(bm: BlockManager, rid: str, ids: list[int]) -> int:
    """Admit a request the way the scheduler does; returns how many tokens came from the cache."""
    prefix = bm.cached_prefix(rid, len(ids), tok(ids))
    assert bm.allocate(rid, len(ids), prefix)
    return len(prefix) * bm.block_size


def test_second_request_shares_full_blocks_only_after_they_are_registered():
    bm = cached_bm()
    ids = list(range(100, 111))  # 11 tokens: 2 full blocks + a partial one
    assert admit(bm, "a", ids) == 0
    assert bm.cached_prefix("b", len(ids), tok(ids)) == []  # scheduled, not written: no hit yet
    bm.register_computed("a", len(ids), tok(ids))
    assert admit(bm, "b", ids) == 8
    a, b = bm.block_table("a"), bm.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]  # the partial last block is never shared
    bm.check_invariants()


def test_hit_leaves_the_last_token_to_compute():
    bm = cached_bm()
    ids = list(range(8))  # exactly two blocks
    admit(bm, "a", ids)
    bm.register_computed("a", 8, tok(ids))
    # the whole prompt is cached, but the last token must run to give logits: only the first block is hit
    assert len(bm.cached_prefix("b", 8, tok(ids))) == 1
    # one more token (a longer prompt) and both blocks are usable
    assert len(bm.cached_prefix("c", 9, tok(ids + [5]))) == 2


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    bm = cached_bm(num_blocks=4, block_size=2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    for rid, ids in (("x", x), ("y", y)):
        admit(bm, rid, ids)
        bm.register_computed(rid, 4, tok(ids))
        bm.free(rid)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4 and bm.usage == 0.0
    # x was freed first, so its blocks go first; y's survive
    assert bm.allocate("z", 4)
    assert bm.cached_prefix("x2", 5, tok(x + [0])) == []  # no stale hit after eviction
    assert len(bm.cached_prefix("y2", 5, tok(y + [0]))) == 2
    bm.check_invariants()


def test_preemption_drops_references_not_content():
    bm = cached_bm()
    ids = list(range(50, 63))
    admit(bm, "a", ids)
    bm.register_computed("a", 13, tok(ids))
    blocks = bm.block_table("a")[:3]
    bm.free("a")
    assert bm.cached_prefix("a", 13, tok(ids)) == blocks


def test_salt_and_tokens_change_the_hash():
    root = root_hash("model-a|float32")
    assert root != root_hash("model-a|bfloat16")
    assert block_hash(root, [1, 2, 3]) == block_hash(root, [1, 2, 3])
    assert block_hash(root, [1, 2, 3]) != block_hash(root, [1, 2, 4])
    assert block_hash(block_hash(root, [1]), [2]) != block_hash(block_hash(root, [9]), [2])
    a, b = cached_bm(salt="one"), cached_bm(salt="two")
    ids = list(range(9))
    for bm in (a, b):
        admit(bm, "r", ids)
        bm.register_computed("r", 9, tok(ids))
    assert len(a.cached_prefix("s", 9, tok(ids))) == 2
    assert a._hash_of[a.block_table("r")[0]] != b._hash_of[b.block_table("r")[0]]


def test_reset_forgets_every_cached_block():
    bm = cached_bm()
    ids = list(range(12))
    admit(bm, "a", ids)
    bm.register_computed("a", 12, tok(ids))
    assert bm.reset_prefix_cache() == 3
    assert bm.cached_prefix("b", 12, tok(ids)) == []
    bm.free("a")
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


def test_blocks_to_take_counts_unheld_cached_blocks():
    bm = cached_bm(num_blocks=4, block_size=2)
    ids = [1, 2, 3, 4, 5]
    admit(bm, "a", ids)
    bm.register_computed("a", 5, tok(ids))
    bm.free("a")
    prefix = bm.cached_prefix("b", 5, tok(ids))
    assert len(prefix) == 2
    # two cached blocks leave the free pool plus one fresh block for the last token
    assert bm.blocks_to_take("b", 5, prefix) == 3
    assert bm.allocate("b", 5, prefix) and bm.num_free_blocks == 1


# ---- properties ---------------------------------------------------------------------------------------
# Prompts over a tiny alphabet share prefixes often; a few requests come and go, some are "computed".
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
ops = st.lists(
    st.tuples(st.sampled_from(["admit", "compute", "free", "reset"]), st.sampled_from("abcde"), prompts),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_properties_of_the_prefix_cache(ops):
    bm = cached_bm(num_blocks=10, block_size=2)
    content: dict[int, tuple[int, ...]] = {}  # block -> the token prefix its K/V was computed for
    prompt_of: dict[str, list[int]] = {}
    for op, rid, ids in ops:
        if op == "admit" and rid not in prompt_of:
            prefix = bm.cached_prefix(rid, len(ids), tok(ids))
            for i, b in enumerate(prefix):
                # a hit is exactly the same token prefix as the block was computed for: no stale hit
                assert content[b] == tuple(ids[: (i + 1) * 2])
            assert len(prefix) * 2 <= len(ids) - 1
            if bm.allocate(rid, len(ids), prefix):
                prompt_of[rid] = ids
                for i, b in enumerate(bm.block_table(rid)[len(prefix) :], start=len(prefix)):
                    content[b] = tuple(ids[: (i + 1) * 2])  # a fresh block will hold this prefix
        elif op == "compute" and rid in prompt_of:
            bm.register_computed(rid, len(prompt_of[rid]), tok(prompt_of[rid]))
        elif op == "free" and rid in prompt_of:
            held = set(bm.block_table(rid))
            bm.free(rid)
            del prompt_of[rid]
            others = {b for r in prompt_of for b in bm.block_table(r)}
            # no block is freed (allocatable fresh) while another request still references it
            for b in held & others:
                assert b not in bm._free and b not in bm._evictable
        elif op == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
        # identical hashes only for identical token prefixes
        by_hash = {h: content[b] for b, h in bm._hash_of.items()}
        assert len(set(by_hash.values())) == len(by_hash)
