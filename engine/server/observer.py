"""Events the async engine reports, and a fan-out to several observers (Prometheus metrics, the sliding
window behind /admin/v1/stats). Observers are called from the engine thread and, for arrivals and
rejections, from the HTTP event loop: implementations must be thread-safe."""

from __future__ import annotations

from stallfree.engine.outputs import IterationStats, RequestMetrics


class EngineObserver:
    """No-op base: override what you need. Times are seconds."""

    def on_arrival(self, cluster: str, prompt_tokens: int) -> None: ...

    def on_rejected(self, cluster: str, reason: str) -> None: ...

    def on_scheduled(self, cluster: str, delay: float) -> None: ...

    def on_first_token(self, cluster: str, ttft: float) -> None: ...

    def on_token_gaps(self, cluster: str, gaps: list[float]) -> None: ...

    def on_generation_tokens(self, cluster: str, n: int) -> None: ...

    def on_finished(self, cluster: str, outcome: str, e2e: float) -> None: ...

    def on_request_done(
        self, cluster: str, outcome: str, metrics: RequestMetrics, prompt_tokens: int, max_tokens: int
    ) -> None:
        """A request's whole timeline once it finished (queue, prefill, decode times; token counts)."""

    def on_iteration(
        self, stats: IterationStats | None, waiting: dict[str, int], running: dict[str, int], kv_usage: float
    ) -> None: ...

    def on_config(self, config) -> None: ...  # a traffic.TrafficConfig


class FanOut(EngineObserver):
    def __init__(self, *observers: EngineObserver) -> None:
        self.observers = list(observers)

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            targets = object.__getattribute__(self, "observers")

            def call(*args, **kw) -> None:
                for o in targets:
                    getattr(o, name)(*args, **kw)

            return call
        return object.__getattribute__(self, name)
