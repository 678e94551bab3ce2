"""Token masks filled by a worker thread while the model runs, read by the sampler when it needs them.

One `MaskBatch` per engine step holds a (R, ceil(V/32)) int32 bitmask, one row per constrained request that
samples this step (bit t % 32 of word t // 32 set = token t allowed). The engine starts filling it right
after scheduling; the grammar engine releases the GIL, so the fill overlaps the forward pass and the
sampler waits only for whatever is left of it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch


class MaskBatch:
    """This step's bitmask, (R, W) int32 on the CPU, available once the worker has filled it."""

    def __init__(self, future: Future[torch.Tensor]) -> None:
        self._future = future

    def result(self) -> torch.Tensor:
        return self._future.result()


@dataclass(frozen=True, slots=True)
class TokenMask:
    """One request's row of a MaskBatch: what `SampleRequest.allowed_tokens` holds."""

    batch: MaskBatch
    row: int

    def bitmask(self) -> torch.Tensor:
        """(W,) int32: waits for the fill if it is still running."""
        return self.batch.result()[self.row]
