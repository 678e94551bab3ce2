"""Factories for scheduler and block-manager tests (no torch): build what a test needs, visibly."""

from __future__ import annotations

import itertools

from stallfree.engine.block_manager import BlockManager
from stallfree.engine.config import SchedulerConfig, SchedulerTunables, TrafficClusterLimits
from stallfree.engine.request import Request, RequestStatus
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import Scheduler, SchedulerOutput

_ids = itertools.count()


def make_scheduler(
    policy: str = "sarathi",
    token_budget: int = 64,
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    chunk_align: int = 0,
    hybrid_batching: bool = True,
    clusters: tuple[TrafficClusterLimits, ...] = (),
    prefix_caching: bool = False,
    chunk_context_scale: int | None = None,
    time_target: float | None = None,
    min_token_budget: int = 16,
    cost_model=None,
) -> Scheduler:
    cfg = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        chunk_align=chunk_align,
        hybrid_batching=hybrid_batching,
        chunk_context_scale=chunk_context_scale,
        tunables=SchedulerTunables(
            token_budget=token_budget,
            clusters=clusters,
            time_target=time_target,
            min_token_budget=min_token_budget,
        ),
    )
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(cfg, bm, cost_model)


def make_request(
    prompt_len: int,
    max_tokens: int = 4,
    cluster: str = "default",
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt)
        if prompt is not None
        else [(7 * i) % 100 + 1 for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_time=arrival,
        traffic_cluster=cluster,
        priority=priority,
    )


def make_requests(prompt_lens, max_tokens: int = 4, **kw) -> list[Request]:
    return [make_request(n, max_tokens, arrival=float(i), **kw) for i, n in enumerate(prompt_lens)]


def fake_step(sched: Scheduler, out: SchedulerOutput, token: int = 5) -> list[Request]:
    """Pretend the model ran: sampled requests get `token`; those at max_tokens finish. Returns finished."""
    finished = []
    for c in out.chunks:
        if not c.sample:
            continue
        req = sched.get(c.request_id)
        req.output_token_ids.append(token)
        if len(req.output_token_ids) >= req.sampling_params.max_tokens:
            sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
            finished.append(req)
    return finished


def drive(
    sched: Scheduler, requests: list[Request], max_steps: int = 10_000, on_step=None
) -> list[SchedulerOutput]:
    """Run the scheduler to completion with fake model steps; returns every iteration's output."""
    for r in requests:
        sched.add_request(r)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        before = {r.request_id: (r.status, r.in_decode) for r in sched.running}
        out = sched.schedule()
        if on_step is not None:
            on_step(sched, out, before)
        outs.append(out)
        fake_step(sched, out)
    raise AssertionError(f"requests did not finish within {max_steps} iterations")
