"""Request state as the engine tracks it.

A request's tokens are its prompt followed by its outputs. `num_computed_tokens` is how many of them have
K/V in the cache; each iteration the scheduler lets it catch up by some tokens (a prefill chunk, or the one
new token of a decode). When it catches up to `num_tokens`, the model's last logits are sampled and one more
token is appended. Preemption by recompute just sets `num_computed_tokens` back to 0.

Ownership: the scheduler changes `status` and `num_computed_tokens`; the engine appends outputs and
finishes requests. Nothing else writes here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stallfree.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    traffic_cluster: str = "default"
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    # Timestamps (engine clock, seconds): first time any of its tokens ran, first output, each output.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet (1 for a running decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_decode(self) -> bool:
        """True when only the newest output token is left to run: the request is decoding."""
        return self.num_computed_tokens >= self.prompt_len and self.num_pending_tokens == 1

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids [start, stop) of prompt + outputs, without building the whole list."""
        p = self.prompt_len
        if stop <= p:
            return tuple(self.prompt_token_ids[start:stop])
        if start >= p:
            return tuple(self.output_token_ids[start - p : stop - p])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: stop - p])

    @property
    def finished(self) -> bool:
        return self.status.finished
