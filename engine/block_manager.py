"""Paged KV cache bookkeeping: integers only, no torch.

The cache is `num_blocks` blocks of `block_size` token slots. A request owns a block table (block ids in
order); token at absolute position p lives in slot `table[p // block_size] * block_size + p % block_size`.
Allocation is all-or-nothing and returns False when there is no room: the scheduler decides whom to
preempt. Free blocks are a stack, so allocate and free are O(1) per block.
"""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Reversed so block 0 is handed out first (helps reading dumps; order is otherwise irrelevant).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        need = blocks_needed(num_tokens, self.block_size) - self.num_blocks_of(request_id)
        return need <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover `num_tokens` token slots. False (and no change) if no room."""
        table = self._tables.setdefault(request_id, [])
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        for _ in range(need):
            table.append(self._free.pop())
        return True

    def free(self, request_id: str) -> int:
        """Return all of a request's blocks; returns how many were freed (0 if it had none)."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def check_invariants(self) -> None:
        """Every block is either free or in exactly one table (used by tests)."""
        owned = [b for t in self._tables.values() for b in t]
        all_blocks = owned + self._free
        if sorted(all_blocks) != list(range(self.num_blocks)):
            raise AssertionError("blocks leaked or double-owned")
