"""How the torch backend groups an iteration's decodes for padded attention.

Pure Python (no torch): the engine's attention metadata and the cost model's `decode_attn` feature both call
`decode_groups`, so the simulator prices exactly the padding the engine pays.

The torch backend attends for a group of decodes as one padded SDPA call, each decode padded to the group's
longest history. A single group for all decodes would make a chat decode at 100 tokens of context cost as
much as a document decode at 4,000 in the same batch. Groups split where the padding
would at least double a decode's work and save a real amount of it; each extra group costs a few small
kernel launches per layer, so they are few (at most about log2(longest / MIN_GAP) + 1).
"""

from __future__ import annotations

from collections.abc import Sequence

# The cpu backend's paged decode kernel reads each decode's keys in place, one (decode, KV head) per task;
# SDPA over gathered pages works in blocks and wins on big ones. Measured on the SmolLM2 shapes, 2 threads
# (docs/engine.md): the kernel is faster at 32 decodes x 128 keys and 1 x 1024, slower at 32 x 1024. So
# an iteration whose decodes x longest history exceed this attends in the padded groups instead.
PAGED_DECODE_MAX_KEYS = 16384

# A decode starts a new group only if its history is at most half the group's longest and at least this
# many tokens shorter: below that the saving is smaller than a group's fixed cost.
MIN_GAP = 64


def decode_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Indices into `lengths` (each decode's history length, new token included), grouped; groups and
    their members run from the longest history down. Every index appears exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    top = 0
    for i in order:
        n = lengths[i]
        if not groups or (2 * n <= top and top - n >= MIN_GAP):
            groups.append([i])
            top = n
        else:
            groups[-1].append(i)
    return groups


def fits_paged_kernel(lengths: Sequence[int]) -> bool:
    """Whether the cpu backend attends for these decodes with its paged kernel (no padding)."""
    return 0 < len(lengths) * max(lengths, default=0) <= PAGED_DECODE_MAX_KEYS


def attended_decode_area(lengths: Sequence[int]) -> int:
    """Key positions the CPU engine's decodes attend to: their histories through the paged kernel, or the
    padded groups' area when the iteration is too big for it (see PAGED_DECODE_MAX_KEYS)."""
    return sum(lengths) if fits_paged_kernel(lengths) else padded_decode_area(lengths)


def padded_decode_area(lengths: Sequence[int]) -> int:
    """Key positions the grouped decodes attend to, padding included: sum of group size x group longest."""
    return sum(len(g) * lengths[g[0]] for g in decode_groups(lengths))
