"""The cost model's calibration health as the server reports it: quantiles of |predicted / observed - 1|
over the last iterations (metrics and /admin/v1/stats), computed every few iterations, not every one."""

from __future__ import annotations

from collections import deque

WINDOW = 512  # iterations
EVERY = 16  # recompute the quantiles this often


class CalibrationWindow:
    def __init__(self, window: int = WINDOW, every: int = EVERY) -> None:
        self._dev: deque[float] = deque(maxlen=window)
        self._every = every
        self._n = 0
        self.last: tuple[float, float] | None = None  # (median, p95) at the last recompute

    def add(self, ratio: float) -> tuple[float, float] | None:
        """Take one predicted/observed ratio; returns (median, p95) of |ratio - 1| when recomputed."""
        self._dev.append(abs(ratio - 1.0))
        self._n += 1
        if self._n % self._every and self._n > 1:
            return None
        ordered = sorted(self._dev)
        n = len(ordered)
        self.last = (ordered[n // 2], ordered[min(n - 1, int(0.95 * n))])
        return self.last
