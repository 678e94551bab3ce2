"""Paged KV cache bookkeeping: integers only, no torch.

The cache is `num_blocks` blocks of `block_size` token slots. A request owns a block table (block ids in
order); token at absolute position p lives in slot `table[p // block_size] * block_size + p % block_size`.
Allocation is all-or-nothing and returns False when there is no room: the scheduler decides whom to
preempt. Free blocks are a stack, so allocate and free are O(1) per block.

Prefix caching (`enable_prefix_caching`): a full block whose K/V has been written is registered under a
hash chained over its parent block's hash and its own token ids (the chain starts from a per-engine salt:
model and dtype, anything else that changes K/V). A new request takes the longest chain of registered
blocks that its tokens hash to (`cached_prefix`), sharing them by reference count. A block no table holds
keeps its content and hash, and waits in least-recently-used order to be evicted when a fresh block is
needed. Only full blocks are ever registered, so a shared block is immutable: no copy-on-write. The
partial last block of a request is always its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

TokenSlice = Callable[[int, int], Sequence[int]]  # (start, stop) -> token ids of that range


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: SHA-256 over the parent block's key and this block's token ids.

    Identical keys mean identical token prefixes (up to SHA-256 collisions): the chain commits to every
    token before this block and to the salt at its root."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def root_hash(salt: str) -> bytes:
    """The parent of every request's first block: whatever besides the tokens decides the K/V."""
    return hashlib.sha256(b"stallfree-prefix-cache\0" + salt.encode()).digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False, salt: str = ""
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root = root_hash(salt)
        # Reversed so block 0 is handed out first (helps reading dumps; order is otherwise irrelevant).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._refs = [0] * num_blocks
        # Prefix cache: hash -> block, block -> hash, and the unreferenced cached blocks, oldest first.
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Per request: its full blocks' hashes (memo), and how many of its table's blocks are registered.
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, or cached but held by no request."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held by requests or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        need = blocks_needed(num_tokens, self.block_size) - self.num_blocks_of(request_id)
        return need <= self.num_free_blocks

    # ---- prefix cache ---------------------------------------------------------------------------------
    def _block_hashes(self, request_id: str, num_full: int, tokens: TokenSlice) -> list[bytes]:
        """The hashes of the request's first `num_full` full blocks (memoised per request)."""
        hs = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hs) < num_full:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else self._root, tokens(i * bs, (i + 1) * bs)))
        return hs

    def cached_prefix(self, request_id: str, num_tokens: int, tokens: TokenSlice) -> list[int]:
        """The cached blocks a request of `num_tokens` tokens may start from: the longest registered chain
        of its full blocks, leaving at least one token to compute (the model must produce logits for the
        last one). Takes no references; pass the result to `allocate(..., prefix=)`."""
        if not self.enable_prefix_caching or num_tokens < 2:
            return []
        # NOTE: (num_tokens - 1) // bs: a prompt that fills its last block exactly still recomputes that
        # whole last block, so its last token runs through the model.
        hs = self._block_hashes(request_id, (num_tokens - 1) // self.block_size, tokens)
        hit: list[int] = []
        for h in hs[: (num_tokens - 1) // self.block_size]:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def next_block_hash(
        self, request_id: str, num_cached_blocks: int, num_tokens: int, tokens: TokenSlice
    ) -> bytes | None:
        """Hash of the block after the request's `num_cached_blocks` cached ones, or None when that block
        could not come from the cache anyway (it is partial, or holds the last token)."""
        if (num_cached_blocks + 1) * self.block_size > num_tokens - 1:
            return None
        return self._block_hashes(request_id, num_cached_blocks + 1, tokens)[num_cached_blocks]

    def pending_hashes(self, request_id: str, num_tokens: int, tokens: TokenSlice) -> list[bytes]:
        """Hashes of the request's full blocks (of its first `num_tokens` tokens) not registered yet: being
        computed, or to be (for avoiding duplicate prefill of the same block)."""
        first = self._num_registered.get(request_id, 0)
        return self._block_hashes(request_id, num_tokens // self.block_size, tokens)[first:]

    def blocks_to_take(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Free blocks `allocate(request_id, num_tokens, prefix=prefix)` would use up (cached blocks that
        nobody holds count: taking them removes them from the free pool)."""
        if self._tables.get(request_id):
            prefix = ()
        fresh = blocks_needed(num_tokens, self.block_size) - self.num_blocks_of(request_id) - len(prefix)
        return max(fresh, 0) + sum(1 for b in prefix if self._refs[b] == 0)

    def register_computed(self, request_id: str, num_computed_tokens: int, tokens: TokenSlice) -> int:
        """Register the request's full blocks whose K/V is written (its first `num_computed_tokens` tokens).

        NOTE: call only once the iteration that computed them has finished. Returns how many blocks were
        newly registered. A block whose hash another block already holds (two requests computed the same
        tokens) stays private and is freed normally."""
        if not self.enable_prefix_caching:
            return 0
        table = self._tables.get(request_id)
        if not table:
            return 0
        num_full = min(num_computed_tokens // self.block_size, len(table))
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return 0
        hs = self._block_hashes(request_id, num_full, tokens)
        added = 0
        for i in range(done, num_full):
            b, h = table[i], hs[i]
            if b in self._hash_of or h in self._cached:
                continue
            self._cached[h] = b
            self._hash_of[b] = h
            added += 1
        self._num_registered[request_id] = num_full
        return added

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (held ones stay with their requests but are no longer shared).
        Returns how many blocks were dropped from the cache."""
        n = len(self._cached)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
        return n

    # ---- allocation -------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._evictable.popitem(last=False)  # least recently used
        del self._cached[self._hash_of.pop(b)]
        return b

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Make the request's table cover `num_tokens` token slots. False (and no change) if no room.

        `prefix` (only when the request holds no blocks yet): cached blocks from `cached_prefix` that start
        its table, shared by reference."""
        table = self._tables.get(request_id)
        if table:
            prefix = ()
        if self.blocks_to_take(request_id, num_tokens, prefix) > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        for b in prefix:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
            table.append(b)
        if prefix:
            self._num_registered[request_id] = len(prefix)
        for _ in range(blocks_needed(num_tokens, self.block_size) - len(table)):
            b = self._take_free_block()
            self._refs[b] = 1
            table.append(b)
        if not table:
            del self._tables[request_id]
        return True

    def free(self, request_id: str) -> int:
        """Drop a request's references; returns how many blocks it held (0 if none). Blocks nobody holds any
        more return to the free pool, cached ones keeping their content until evicted."""
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        # Tail first: a request's last blocks are the least likely to be shared, so they are evicted first.
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        return len(table)

    def check_invariants(self) -> None:
        """Every block is free, cached-and-unheld, or held by tables with a matching reference count
        (used by tests)."""
        counts = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t:
                counts[b] += 1
        if counts != self._refs:
            raise AssertionError("reference counts do not match the block tables")
        held = {b for b in range(self.num_blocks) if counts[b] > 0}
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable or (free | evictable) & held:
            raise AssertionError("a block is both free and held, or free twice")
        if len(free) + len(evictable) + len(held) != self.num_blocks:
            raise AssertionError("blocks leaked")
        if any(b not in self._hash_of for b in evictable):
            raise AssertionError("an evictable block has no hash")
        if any(b in self._hash_of for b in free):
            raise AssertionError("a plain free block still has a hash")
        if {self._cached[h]: h for h in self._cached} != self._hash_of:
            raise AssertionError("hash maps disagree")
