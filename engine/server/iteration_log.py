"""The server's own iteration log: one JSON line per engine iteration, for fitting a cost model to what
this server really does under load (`stallfree profile --from-log`).

An offline profile times the model's forward pass in isolation. A served iteration also pays for what
happens between steps: handing tokens to the HTTP streams, admitting requests, the event loop sharing the
cores. What a client sees as its time between tokens is the *period* from one iteration's end to the
next one's, so each line carries it:

    {"t": 12.345, "step_s": 0.081, "period_s": 0.094, "chunks": [[1, 311, 1], [256, 0, 0]]}

`chunks` is (tokens, start, is_decode) per scheduled chunk. `period_s` is null when the engine had no
work left after the previous iteration (it went idle, so the gap is waiting, not cost).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from stallfree.engine.outputs import IterationStats
from stallfree.engine.server.observer import EngineObserver

FLUSH_EVERY_S = 1.0


class IterationLog(EngineObserver):
    """Appends to `path`; called from the engine thread only (on_iteration), closed at shutdown."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._prev_end: float | None = None  # end of the previous iteration, if it left work behind
        self._last_flush = time.monotonic()

    def on_iteration(
        self, stats: IterationStats | None, waiting: dict[str, int], running: dict[str, int], kv_usage: float
    ) -> None:
        if stats is None:
            return
        period = None if self._prev_end is None else stats.time - self._prev_end
        self._prev_end = stats.time if stats.num_running + stats.num_waiting > 0 else None
        line = {
            "t": round(stats.time, 6),
            "step_s": round(stats.time_total, 6),
            "period_s": None if period is None else round(period, 6),
            "chunks": [[n, start, int(dec)] for n, start, dec in stats.chunk_shapes],
        }
        if stats.predicted_time is not None:  # the engine's cost model: its prediction, and the time to fit
            line["predicted_s"] = round(stats.predicted_time, 6)
            line["limit_s"] = None if stats.time_limit is None else round(stats.time_limit, 6)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            now = time.monotonic()
            if self._prev_end is None or now - self._last_flush >= FLUSH_EVERY_S:  # idle, or a second on
                self._file.flush()
                self._last_flush = now

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
