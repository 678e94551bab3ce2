"""Iteration-level schedulers: who runs in the next forward pass, and how many tokens each.

Pure Python (no torch): the same code drives the real engine and the simulator. Every policy works on one
idea (as in vLLM V1): a request's `num_computed_tokens` catches up to its `num_tokens`; a prefill chunk is
just a cap on how far it catches up this iteration, and a decode is the one token left.

Policies (SchedulerConfig.policy):
  sarathi  stall-free batching: running decodes first (one token each), then running partial prefills, then
           new requests, each chunk = min(remaining prompt, leftover budget, cluster chunk cap), optionally
           tile-aligned; several prefill chunks may share a batch; the budget may change between iterations.
           With chunk_context_scale C, a chunk is charged for the context it attends over (chunk_charge).
           With a time target (SchedulerTunables.time_target) and a cost model, the budget is a time: the
           prefill chunks are the largest set whose predicted iteration time fits the SLOs of the clusters
           decoding in this iteration (time_limit), between the floor and the cap in tokens.
  vllm     the paper's baseline: whole prompts first in prefill-only batches; decodes wait for them.
  orca     decodes plus whole new prompts in one batch, no token cap.
  static   request-level batching: a batch is admitted together and runs until all of it finishes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from stallfree.costmodel.features import add_chunk, decode_features
from stallfree.engine.block_manager import BlockManager
from stallfree.engine.config import SchedulerConfig, SchedulerTunables
from stallfree.engine.request import Request, RequestStatus
from stallfree.engine.sampling_params import SamplingParams

# Keep this fraction of blocks free when admitting new requests, so running decodes are not preempted
# right after an admission.
WATERMARK = 0.01


class IterationCostModel(Protocol):
    """Seconds an iteration with these features takes (stallfree.costmodel: a fit, or the engine's
    calibrated OnlineCostModel). Non-decreasing in every work feature."""

    def predict(self, features: Mapping[str, float]) -> float: ...


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of an iteration: tokens [start, start + len(token_ids)) of prompt + outputs."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int  # NOTE: absolute position of token_ids[0]; positions never restart per chunk
    block_table: tuple[int, ...]
    is_decode: bool
    sample: bool  # the chunk reaches the end of the request's tokens: sample its next token
    traffic_cluster: str
    sampling_params: SamplingParams
    num_output_tokens: int  # outputs generated before this step (for min_tokens, seeds)
    # The prompt, sent once: with the first sample of a request with a repetition penalty (the sampler keeps
    # the penalty history of each such request from then on). Empty otherwise.
    penalty_prompt: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The frozen message from scheduler to model runner: decodes first, then prefill chunks."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    token_budget: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # Prefix cache lookups of the requests admitted this iteration: (traffic cluster, prompt tokens looked
    # up, tokens found cached), one entry per admission.
    prefix_cache: tuple[tuple[str, int, int], ...] = ()
    # Time-budgeted iterations: the time the iteration had to fit (None: no limit, or the token mode) and
    # what the cost model predicted for it (None in the token mode).
    time_limit: float | None = None
    predicted_time: float | None = None
    # Structured outputs: request id -> the token mask its sampled row must obey (a sampler.AllowedTokens).
    # The scheduler leaves it empty; the engine attaches the masks of constrained requests after scheduling.
    allowed_tokens: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def chunk_charge(n: int, start: int, scale: int | None) -> int:
    """What a prefill chunk of n tokens after `start` computed ones costs of the token budget: n, or with a
    context scale C, n * (1 + (start + (n - 1) / 2) / C) rounded up (its tokens' mean context over C)."""
    if scale is None or n == 0:
        return n
    return n + -(-n * (2 * start + n - 1) // (2 * scale))


def fit_chunk(left: int, start: int, scale: int | None) -> int:
    """The most tokens a chunk after `start` computed ones may have with `left` of the budget."""
    if scale is None or left < 1:
        return max(left, 0)
    # chunk_charge is increasing in n: start from the real root of n^2 + (2 C + 2 s - 1) n = 2 C left
    b = 2 * scale + 2 * start - 1
    n = int((-b + (b * b + 8 * scale * left) ** 0.5) / 2)
    n = max(min(n, left), 0)
    while n < left and chunk_charge(n + 1, start, scale) <= left:
        n += 1
    while n > 0 and chunk_charge(n, start, scale) > left:
        n -= 1
    return n


@dataclass(slots=True)
class _Batch:
    """Accumulates one iteration's chunks and what they use of the budget."""

    budget: int | None  # None = no token cap
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    cluster_prefill: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    paused: set[str] = field(default_factory=set)  # running but over their cluster's maxRunning
    prefix_cache: list[tuple[str, int, int]] = field(default_factory=list)
    used: int = 0
    # Time-budgeted: the iteration's features so far and the time it must fit (None: token mode or no limit)
    features: dict[str, float] | None = None
    time_limit: float | None = None
    floor: int = 0  # tokens the iteration may hold whatever the prediction (the floor in tokens)

    @property
    def left(self) -> int:
        return 1 << 62 if self.budget is None else self.budget - self.used

    def add(self, req: Request, n: int, charge: int | None = None) -> None:
        self.chunks.append((req, n))
        self.scheduled.add(req.request_id)
        self.used += n if charge is None else charge
        if not req.in_decode:
            self.cluster_prefill[req.traffic_cluster] = self.cluster_prefill.get(req.traffic_cluster, 0) + n
            if self.features is not None:
                add_chunk(self.features, n, req.num_computed_tokens)


class Scheduler:
    """Holds the waiting and running requests and builds each iteration's batch."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        cost_model: IterationCostModel | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.tunables: SchedulerTunables = config.tunables
        # Time-budgeted iterations need it; the engine gives its calibrated model (None: token budgets only)
        self.cost_model = cost_model
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._last_was_prefill = False  # for sarathi without hybrid batching
        self._order = itertools.count()
        self._seq: dict[str, int] = {}
        # Pipeline parallelism: requests whose micro-batch has not come back yet. NOTE: they are never
        # scheduled or preempted until `complete` (their next token is not known, their blocks are in use).
        self.in_flight: set[str] = set()

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self._requests[req.request_id] = req
        self._seq[req.request_id] = next(self._order)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished, aborted or failed) and free its blocks."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._seq.pop(request_id, None)
        if status is not RequestStatus.FINISHED_ERROR and request_id not in self.in_flight:
            # NOTE: what it computed is in the cache (not so for a failed forward pass, or a micro-batch
            # still in flight), so the next request with the same prefix (the next turn) can reuse it.
            self.block_manager.register_computed(request_id, req.num_computed_tokens, req.token_slice)
        self.in_flight.discard(request_id)
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(request_id)
        return req

    def mark_in_flight(self, out: SchedulerOutput) -> None:
        """The micro-batch `out` was submitted: its requests sit out until `complete(out)`."""
        self.in_flight.update(c.request_id for c in out.chunks)

    def complete(self, out: SchedulerOutput) -> None:
        """The micro-batch `out` came back: its requests may be scheduled again."""
        self.in_flight.difference_update(c.request_id for c in out.chunks)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def count_by_cluster(self, requests: Iterable[Request]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in requests:
            counts[r.traffic_cluster] = counts.get(r.traffic_cluster, 0) + 1
        return counts

    # ---- helpers shared by the policies -----------------------------------------------------------
    def _key(self, req: Request) -> tuple[int, float, int]:
        # Higher priority first, then first come first served.
        return (-req.priority, req.arrival_time, self._seq[req.request_id])

    def _chunk_size(self, req: Request, batch: _Batch, whole: bool) -> int:
        remaining = req.num_pending_tokens
        if whole:
            return remaining if remaining <= batch.left else 0
        timed = batch.features is not None
        scale = None if timed else self.config.chunk_context_scale
        n = min(remaining, fit_chunk(batch.left, req.num_computed_tokens, scale))
        limits = self.tunables.cluster(req.traffic_cluster)
        if limits is not None and limits.chunk_cap is not None:
            n = min(n, limits.chunk_cap - batch.cluster_prefill.get(req.traffic_cluster, 0))
        if timed and n > 0:
            n = self._fit_time(n, req.num_computed_tokens, batch)
        align = self.config.chunk_align
        if align and n < remaining:
            n -= n % align
        return max(n, 0)

    @property
    def time_budgeted(self) -> bool:
        """Whether sarathi's iterations are budgeted in time now (a time target and a cost model)."""
        return self.tunables.time_target is not None and self.cost_model is not None

    def _fit_time(self, n: int, start: int, batch: _Batch) -> int:
        """The longest chunk of at most `n` tokens after `start` whose iteration (with what `batch` holds)
        the cost model predicts within the batch's time limit; at least what the floor leaves."""
        limit, base, model = batch.time_limit, batch.features, self.cost_model
        if limit is None or base is None or model is None:
            return n

        def fits(k: int) -> bool:
            f = dict(base)
            add_chunk(f, k, start)
            return model.predict(f) <= limit

        floor = min(n, max(batch.floor - batch.used, 0))
        if fits(n):
            return n
        lo, hi = 0, n  # fits(lo) or lo is 0; not fits(hi). NOTE: the model is non-decreasing in k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return max(lo, floor)

    def _charge(self, req: Request, n: int, whole: bool) -> int:
        # NOTE: called before the chunk is computed: num_computed_tokens is where it starts
        if whole or self.time_budgeted:
            return n
        return chunk_charge(n, req.num_computed_tokens, self.config.chunk_context_scale)

    def time_limit(self, decoding: Iterable[Request]) -> float | None:
        """Seconds the next iteration may take (time-budgeted mode), from the SLOs of the clusters with a
        request decoding in it (`decoding`) and of those waiting for a first token; None = no limit (only
        the cap in tokens), as when nothing decodes and nobody waiting has a TTFT SLO."""
        target = self.tunables.time_target
        if target is None:
            return None
        limit = math.inf
        for cluster in {r.traffic_cluster for r in decoding}:
            c = self.tunables.cluster(cluster)
            tbt = c.tbt_slo if c is not None and c.tbt_slo is not None else self.config.default_tbt_slo
            limit = min(limit, target * tbt)
        first_token = {r.traffic_cluster for r in self.waiting}
        first_token.update(r.traffic_cluster for r in self.running if not r.in_decode)
        for cluster in first_token:
            c = self.tunables.cluster(cluster)
            if c is not None and c.ttft_slo is not None:
                limit = min(limit, self.tunables.ttft_share * c.ttft_slo)
        return None if math.isinf(limit) else limit

    def _preempt(self, req: Request, batch: _Batch) -> None:
        self.running.remove(req)
        # Preemption drops references, not cached content: on re-admission the request takes back whatever
        # of its blocks was not evicted meanwhile.
        self.block_manager.register_computed(req.request_id, req.num_computed_tokens, req.token_slice)
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)
        batch.preempted.append(req.request_id)

    def _allocate_running(self, req: Request, num_tokens: int, batch: _Batch) -> bool:
        """Make room for a running request, preempting the least important unscheduled others.

        Returns False if `req` cannot run this iteration: it was preempted itself (nothing less important
        could give way), or it waits, keeping its blocks, for a less important in-flight request to land.
        """
        while not self.block_manager.allocate(req.request_id, num_tokens):
            victims = [
                r
                for r in self.running
                if r is not req and r.request_id not in batch.scheduled and r.request_id not in self.in_flight
            ]
            if not victims:
                if any(self._key(r) > self._key(req) for r in self.running if r.request_id in self.in_flight):
                    # NOTE: a less important request holds blocks but is in flight (pipeline parallelism):
                    # wait for it to land and preempt it then. Preempting `req` instead threw its progress
                    # away, and two long prompts could take turns doing that to each other forever.
                    return False
                self._preempt(req, batch)
                return False
            self._preempt(max(victims, key=self._key), batch)
        return True

    def _can_admit(self, req: Request, num_tokens: int, prefix: list[int]) -> bool:
        bm = self.block_manager
        need = bm.blocks_to_take(req.request_id, num_tokens, prefix)
        return bm.num_free_blocks - need >= int(WATERMARK * bm.num_blocks)

    def _register_computed(self) -> None:
        """Put the full blocks that finished iterations wrote into the prefix cache.

        NOTE: runs before each schedule, when every request not in flight has its first
        `num_computed_tokens` tokens' K/V written (schedule() advanced them, and that iteration is done)."""
        for req in self.running:
            if req.request_id not in self.in_flight:
                self.block_manager.register_computed(req.request_id, req.num_computed_tokens, req.token_slice)

    def _pending_blocks(self, batch: _Batch) -> set[bytes]:
        """Hashes of full blocks that running prefills are computing (or will): a waiting request whose
        next uncached block is among them waits for it to be cached instead of computing it twice."""
        bm = self.block_manager
        out: set[bytes] = set()
        for req in self.running:
            if not req.in_decode and req.request_id not in batch.paused:
                out.update(bm.pending_hashes(req.request_id, req.num_tokens, req.token_slice))
        return out

    def _cluster_has_room(self, req: Request) -> bool:
        limits = self.tunables.cluster(req.traffic_cluster)
        if limits is None or limits.max_running is None:
            return True
        running = sum(1 for r in self.running if r.traffic_cluster == req.traffic_cluster)
        return running < limits.max_running

    def _paused(self) -> set[str]:
        """Running requests over their cluster's maxRunning (lowered while they ran) that have not produced
        a token yet: the latest arrivals beyond the limit sit out, keeping their KV blocks, until the limit
        rises or others finish. Requests already streaming always go on (pausing one would stall its
        stream) and count against the limit first. A lowered limit thus stops new prefill work at the next
        iteration, and running decodes drain as they finish."""
        left: dict[str, int] = {}  # slots left under each capped cluster's limit
        pausable = []
        for req in sorted(self.running, key=self._key):
            limits = self.tunables.cluster(req.traffic_cluster)
            if limits is None or limits.max_running is None:
                continue
            left.setdefault(req.traffic_cluster, limits.max_running)
            if req.output_token_ids or req.request_id in self.in_flight:
                left[req.traffic_cluster] -= 1
            else:
                pausable.append(req)
        out: set[str] = set()
        for req in pausable:
            if left[req.traffic_cluster] > 0:
                left[req.traffic_cluster] -= 1
            else:
                out.add(req.request_id)
        return out

    def _schedule_decodes(self, batch: _Batch) -> None:
        for req in sorted(self.running, key=self._key):
            if (
                req.status is not RequestStatus.RUNNING
                or not req.in_decode
                or req.request_id in self.in_flight
                or req.request_id in batch.paused
            ):
                continue  # preempted earlier in this loop, still prefilling, or in another micro-batch
            if batch.left < 1:
                break
            if self._allocate_running(req, req.num_tokens, batch):
                batch.add(req, 1)

    def _schedule_running_prefills(self, batch: _Batch, whole: bool) -> None:
        for req in sorted(self.running, key=self._key):
            if (
                req.status is not RequestStatus.RUNNING
                or req.in_decode
                or req.request_id in batch.scheduled
                or req.request_id in self.in_flight
                or req.request_id in batch.paused
            ):
                continue
            n = self._chunk_size(req, batch, whole)
            if n == 0:
                continue
            if self._allocate_running(req, req.num_computed_tokens + n, batch):
                batch.add(req, n, self._charge(req, n, whole))

    def _admit_waiting(self, batch: _Batch, whole: bool) -> None:
        bm = self.block_manager
        # NOTE: static batches are admitted together and run to the end: waiting for another request's blocks
        # there would mean waiting for its whole generation, so static computes shared blocks twice instead.
        defer = bm.enable_prefix_caching and bool(self.waiting) and self.config.policy != "static"
        pending = self._pending_blocks(batch) if defer else set()
        for req in sorted(self.waiting, key=self._key):
            if len(self.running) >= self.config.max_num_seqs or batch.left < 1:
                break
            if not self._cluster_has_room(req):
                continue
            # A waiting request has nothing computed; with prefix caching it starts after its cached prefix
            # and only the rest is chunked and counted against the budget.
            prefix = bm.cached_prefix(req.request_id, req.num_tokens, req.token_slice)
            req.num_computed_tokens = len(prefix) * bm.block_size
            nxt = (
                bm.next_block_hash(req.request_id, len(prefix), req.num_tokens, req.token_slice)
                if defer
                else None
            )
            if nxt is not None and nxt in pending:
                req.num_computed_tokens = 0
                continue  # another request is filling the next block: take it from the cache when it is done
            n = self._chunk_size(req, batch, whole)
            if n == 0:
                req.num_computed_tokens = 0
                if whole:
                    break  # keep FCFS: a whole prompt that does not fit now blocks those behind it
                continue
            if not self._can_admit(req, req.num_computed_tokens + n, prefix):
                req.num_computed_tokens = 0
                break
            bm.allocate(req.request_id, req.num_computed_tokens + n, prefix)
            if bm.enable_prefix_caching:
                batch.prefix_cache.append((req.traffic_cluster, req.num_tokens, req.num_computed_tokens))
                if req.num_preemptions == 0:
                    req.num_cached_tokens = req.num_computed_tokens
                if defer:
                    pending.update(bm.pending_hashes(req.request_id, req.num_tokens, req.token_slice))
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.add(req, n, self._charge(req, n, whole))

    # ---- policies ------------------------------------------------------------------------------------
    def _schedule_sarathi(self) -> _Batch:
        batch = _Batch(self.tunables.token_budget, paused=self._paused())
        timed = self.time_budgeted
        has_decodes = any(r.in_decode for r in self.running)
        has_prefills = bool(self.waiting) or any(not r.in_decode for r in self.running)
        prefill_turn = (
            not self.config.hybrid_batching
            and has_prefills
            and (not has_decodes or not self._last_was_prefill)
        )
        if self.config.hybrid_batching or not prefill_turn:
            self._schedule_decodes(batch)
        if timed:
            decodes = [r for r, _ in batch.chunks]
            batch.features = decode_features([r.num_computed_tokens + 1 for r in decodes])
            batch.time_limit = self.time_limit(decodes)
            batch.floor = min(self.tunables.min_token_budget, self.tunables.token_budget)
        if self.config.hybrid_batching or prefill_turn:
            self._schedule_running_prefills(batch, whole=False)
            self._admit_waiting(batch, whole=False)
        self._last_was_prefill = prefill_turn
        return batch

    def _schedule_vllm(self) -> _Batch:
        # Prefill-prioritising: whole prompts, alone in their batch, up to the prompt token cap.
        cap = max(self.tunables.token_budget, self.config.max_model_len)
        paused = self._paused()
        batch = _Batch(cap, paused=paused)
        self._schedule_running_prefills(batch, whole=True)
        self._admit_waiting(batch, whole=True)
        if batch.chunks:
            return batch
        batch = _Batch(None, paused=paused)
        self._schedule_decodes(batch)
        return batch

    def _schedule_orca(self) -> _Batch:
        batch = _Batch(None, paused=self._paused())
        self._schedule_decodes(batch)
        self._schedule_running_prefills(batch, whole=True)
        self._admit_waiting(batch, whole=True)
        return batch

    def _schedule_static(self) -> _Batch:
        batch = _Batch(None, paused=self._paused())
        if not self.running:
            self._admit_waiting(batch, whole=True)
            return batch
        self._schedule_decodes(batch)
        self._schedule_running_prefills(batch, whole=True)
        return batch

    def schedule(self) -> SchedulerOutput:
        """Build the next iteration and commit it: scheduled requests' num_computed_tokens advance."""
        policy = self.config.policy
        if self.block_manager.enable_prefix_caching:
            self._register_computed()
        if policy == "sarathi":
            batch = self._schedule_sarathi()
        elif policy == "vllm":
            batch = self._schedule_vllm()
        elif policy == "orca":
            batch = self._schedule_orca()
        else:
            batch = self._schedule_static()
        # Decodes first, then prefill chunks: the runner groups them that way.
        ordered = sorted(batch.chunks, key=lambda rn: not rn[0].in_decode)
        chunks = []
        n_prefill = n_decode = 0
        for req, n in ordered:
            start = req.num_computed_tokens
            is_decode = req.in_decode
            if is_decode:
                n_decode += n
            else:
                n_prefill += n
            chunks.append(
                ScheduledChunk(
                    request_id=req.request_id,
                    token_ids=req.token_slice(start, start + n),
                    start=start,
                    block_table=tuple(self.block_manager.block_table(req.request_id)),
                    is_decode=is_decode,
                    sample=start + n == req.num_tokens,
                    traffic_cluster=req.traffic_cluster,
                    sampling_params=req.sampling_params,
                    num_output_tokens=len(req.output_token_ids),
                    penalty_prompt=_penalty_prompt(req, start + n),
                )
            )
        for req, n in ordered:
            req.num_computed_tokens += n
        predicted = None
        if batch.features is not None and self.cost_model is not None:
            predicted = self.cost_model.predict(batch.features)
        return SchedulerOutput(
            chunks=tuple(chunks),
            preempted=tuple(batch.preempted),
            token_budget=self.tunables.token_budget,
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
            prefix_cache=tuple(batch.prefix_cache),
            time_limit=batch.time_limit,
            predicted_time=predicted,
        )


def _penalty_prompt(req: Request, end: int) -> tuple[int, ...]:
    """The prompt for the sampler's repetition-penalty history: only with a request's first sample."""
    p = req.sampling_params
    if p.repetition_penalty == 1.0 or req.output_token_ids or end != req.num_tokens:
        return ()
    return tuple(req.prompt_token_ids)
