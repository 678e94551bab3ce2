"""What the engine hands back: per-request outputs and per-iteration statistics (no Prometheus here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, best first


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: tuple[float, ...]
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def scheduling_delay(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def tbts(self) -> list[float]:
        """Every gap between consecutive output tokens (seconds)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step. `new_*` fields hold what this step added (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # stop, length, abort, error
    traffic_cluster: str = "default"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI usage cached_tokens)


@dataclass(frozen=True, slots=True)
class IterationStats:
    """One engine step, for metrics and benchmarks."""

    time: float  # when the step ended (engine clock)
    token_budget: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_usage: float
    time_schedule: float
    time_prepare: float
    time_forward: float
    time_sample: float
    time_update: float
    prefill_tokens_by_cluster: dict[str, int] = field(default_factory=dict)
    decode_tokens_by_cluster: dict[str, int] = field(default_factory=dict)
    # (num_tokens, start, is_decode) per scheduled chunk: what a cost model's features are computed from
    chunk_shapes: tuple[tuple[int, int, bool], ...] = ()
    # prefix cache lookups of requests admitted this step: (traffic cluster, tokens looked up, tokens hit)
    prefix_cache: tuple[tuple[str, int, int], ...] = ()
    num_cached_blocks: int = 0
    # The engine's cost model: what it predicted this iteration would take (before it ran), and the time the
    # scheduler had to fit it in (time-budgeted iterations; None: no limit, or a token budget)
    predicted_time: float | None = None
    time_limit: float | None = None
    # (median, P95) of |predicted / observed - 1| over the cost model's last 512 iterations: set every few
    # iterations (None in between)
    cost_model_error: tuple[float, float] | None = None

    @property
    def time_total(self) -> float:
        return (
            self.time_schedule + self.time_prepare + self.time_forward + self.time_sample + self.time_update
        )

    @property
    def overhead_share(self) -> float:
        """Share of the iteration spent outside the model forward (scheduling, metadata, sampling, update)."""
        total = self.time_total
        return 0.0 if total <= 0 else 1.0 - self.time_forward / total
