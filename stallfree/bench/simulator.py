"""Discrete-event simulation of one engine replica: the REAL scheduler on a simulated clock (Vidur-style).

Each iteration the engine's own `Scheduler.schedule()` builds the batch; instead of running the model the
clock advances by the cost model's T(features of that batch), then every chunk that samples gets a token
stamped with the new time. Arrivals are added when the clock passes them. So admission, chunking,
preemption and policy behave exactly as in the server; only the model's time is predicted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stallfree.bench.metrics import ERROR, OK, RequestRecord
from stallfree.bench.traces import Workload
from stallfree.costmodel.calibrate import OnlineCostModel
from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.engine.block_manager import BlockManager
from stallfree.engine.config import SchedulerConfig, SchedulerTunables, TrafficClusterLimits
from stallfree.engine.request import Request, RequestStatus
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import IterationCostModel, Scheduler

# The server's CPU default: 1 GiB of fp32 KV cache for SmolLM2-135M (46080 bytes per token) in 16-token blocks.
DEFAULT_KV_BLOCKS = 1456
POLICY_NAMES = ("sarathi", "sarathi-nohybrid", "vllm", "orca", "static")


def split_policy(name: str) -> tuple[str, bool]:
    """A policy name as the bench commands accept it -> (scheduler policy, hybrid batching).

    `sarathi-nohybrid` is the paper's "chunking only" ablation: sarathi with prefill chunks and decodes in
    separate iterations.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if name == "sarathi-nohybrid":
        return "sarathi", False
    return name, True


TIME_TARGET = 0.8  # `stallfree serve`'s default time target and cap (engine/serve_cli.py)
TIME_CAP = 2048


@dataclass(frozen=True, slots=True)
class ServerEntry:
    """One server of a bench command: a policy with a token budget, or sarathi budgeted in time
    (`time_target` set; `token_budget` is then the cap)."""

    policy: str
    token_budget: int
    time_target: float | None = None


def parse_server_entry(entry: str, default_budget: int) -> ServerEntry:
    """`sarathi@1024` -> a fixed budget of 1024; `sarathi@time` (or `sarathi@time0.7`) -> time-budgeted
    iterations at the server's default target (or 0.7), with its default cap; a bare name takes
    `default_budget`."""
    name, _, spec = entry.strip().partition("@")
    if not spec.startswith("time"):
        return ServerEntry(*parse_policy_entry(entry, default_budget))
    split_policy(name)
    if name != "sarathi":
        raise ValueError(f"policy {entry!r}: only sarathi budgets its iterations in time")
    target = spec[len("time") :]
    try:
        value = float(target) if target else TIME_TARGET
    except ValueError:
        raise ValueError(f"policy {entry!r}: after @time comes the target, e.g. sarathi@time0.8") from None
    if not 0 < value <= 1:
        raise ValueError(f"policy {entry!r}: the time target must be in (0, 1]")
    return ServerEntry(name, TIME_CAP, value)


def parse_policy_entry(entry: str, default_budget: int) -> tuple[str, int]:
    """`sarathi@1024` -> ("sarathi", 1024); a bare name takes `default_budget`. Lets one capacity run
    compare a policy at two budgets (e.g. each tuned for its own SLO)."""
    name, _, budget = entry.strip().partition("@")
    split_policy(name)  # validates the name
    if not budget:
        return name, default_budget
    try:
        value = int(budget)
    except ValueError:
        raise ValueError(
            f"policy {entry!r}: the budget after @ must be an integer, e.g. sarathi@1024"
        ) from None
    if value < 1:
        raise ValueError(f"policy {entry!r}: the budget after @ must be >= 1")
    return name, value


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated replica: the same knobs as `stallfree serve`."""

    policy: str = "sarathi"  # any of POLICY_NAMES
    token_budget: int = 512
    max_num_seqs: int = 128
    num_kv_blocks: int = DEFAULT_KV_BLOCKS
    block_size: int = 16
    max_model_len: int = 8192
    chunk_align: int = 0
    chunk_context_scale: int | None = None  # stallfree serve --chunk-context-scale
    overhead_s: float = 0.0  # per-iteration time outside the profiled engine step (server loop, streaming)
    contention: float = 1.0  # multiply the cost model's (idle-box) time: how much slower a shared box runs
    enable_prefix_caching: bool = True  # as `stallfree serve` (the same block manager, so the same hits)
    # Time-budgeted iterations (stallfree serve's default): the target, and the SLOs of the one cluster
    time_target: float | None = None
    tbt_slo: float | None = None
    ttft_slo: float | None = None

    def scheduler(self, cost_model: IterationCostModel | None = None) -> Scheduler:
        policy, hybrid = split_policy(self.policy)
        cfg = SchedulerConfig(
            policy=policy,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            chunk_align=self.chunk_align,
            chunk_context_scale=self.chunk_context_scale,
            hybrid_batching=hybrid,
            tunables=SchedulerTunables(
                token_budget=self.token_budget,
                clusters=(TrafficClusterLimits(tbt_slo=self.tbt_slo, ttft_slo=self.ttft_slo),),
                time_target=self.time_target,
            ),
        )
        bm = BlockManager(
            self.num_kv_blocks, self.block_size, enable_prefix_caching=self.enable_prefix_caching
        )
        return Scheduler(cfg, bm, cost_model)


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    num_iterations: int = 0
    busy_s: float = 0.0
    iteration_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


def simulate(
    workload: Workload, cost: FittedCostModel, config: SimConfig, max_iterations: int = 2_000_000
) -> SimResult:
    """Replay the workload through the real scheduler; returns one record per request. Time-budgeted
    iterations are predicted as the engine does, by its calibrated cost model (the profile as prior,
    refitted from the simulated iteration times)."""
    predictor = OnlineCostModel(cost.coefficients, gemm_knee=cost.gemm_knee)
    sched = config.scheduler(predictor if config.time_target is not None else None)
    records = {
        r.index: RequestRecord(
            index=r.index,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.output_tokens,
            arrival=r.arrival,
            sent=r.arrival,
        )
        for r in workload.requests
    }
    pending = deque(sorted(workload.requests, key=lambda r: r.arrival))
    res = SimResult(records=[records[r.index] for r in workload.requests])
    clock = 0.0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            sched.add_request(
                Request(
                    request_id=str(r.index),
                    # NOTE: the load generator's ids: prefix-cache hits happen where they do on the server
                    prompt_token_ids=r.token_ids(workload.seed),
                    sampling_params=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                    arrival_time=r.arrival,
                )
            )
        if not sched.has_unfinished():
            clock = pending[0].arrival
            continue
        out = sched.schedule()
        if out.is_empty:
            if pending:  # nothing fits now (KV cache, limits): idle until the next arrival
                clock = max(clock, pending[0].arrival)
                continue
            break  # stuck for good: the rest are errors
        res.num_iterations += 1
        res.num_preemptions += len(out.preempted)
        for c in out.chunks:
            rec = records[int(c.request_id)]
            if rec.scheduling_delay is None:
                rec.scheduling_delay = clock - rec.arrival
        features = iteration_features(out.chunks)
        dt = cost.predict(features) * config.contention + config.overhead_s
        if config.time_target is not None:
            predictor.observe(features, dt)
        clock += dt
        res.busy_s += dt
        res.iteration_times.append(dt)
        for c in out.chunks:
            if not c.sample:
                continue
            req = sched.get(c.request_id)
            rec = records[int(c.request_id)]
            req.output_token_ids.append(1)
            rec.token_times.append(clock)
            rec.output_tokens += 1
            if rec.first_token is None:
                rec.first_token = clock
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                sched.finish_request(c.request_id, RequestStatus.FINISHED_LENGTH)
                rec.finish, rec.outcome = clock, OK
        if res.num_iterations >= max_iterations:
            break
    for rec in res.records:
        if rec.outcome != OK:
            rec.outcome, rec.error = ERROR, "not served by the end of the simulation"
    return res
