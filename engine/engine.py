"""The engine step loop: schedule -> run -> update.

`LLMEngine` is synchronous and single-threaded; the HTTP server drives it from its own thread, and `LLM`
drives it in a loop. The model runs in an executor (stallfree.engine.executor): in this process, or over
T x P worker ranks for tensor/pipeline parallelism; the step is the same. Statistics go to listeners (the
metrics module subscribes); the engine itself imports no Prometheus.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from stallfree.costmodel.calibrate import OnlineCostModel
from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.engine.block_manager import BlockManager, blocks_needed
from stallfree.engine.config import EngineConfig, SchedulerTunables
from stallfree.engine.executor import Executor, ExecutorFailedError, InProcessExecutor
from stallfree.engine.model.loader import LoadedModel, load_model
from stallfree.engine.model_runner import GraphConfig
from stallfree.engine.output_processor import OutputProcessor
from stallfree.engine.outputs import IterationStats, RequestOutput
from stallfree.engine.placement import resolve_placement
from stallfree.engine.request import Request, RequestStatus
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import Scheduler, SchedulerOutput
from stallfree.engine.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)


class _ForwardFailed(Exception):
    """A forward pass raised: the requests of the batches in flight fail, the engine runs on."""


ERROR_EVERY = 16  # iterations between recomputing the cost model's error quantiles (for metrics, stats)

StatsListener = Callable[[IterationStats, list[RequestOutput]], None]


def resolve_max_model_len(requested: int | None, model_len: int) -> int:
    """The context length to serve: `requested` (vLLM's --max-model-len) or, when None, the model's own.

    Raises ValueError when it exceeds the model's (its RoPE tables and training stop there), as vLLM does.
    """
    if requested is None:
        return model_len
    if requested > model_len:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's context length {model_len} "
            "(max_position_embeddings in its config): give at most that, or leave it unset"
        )
    return requested


class LLMEngine:
    """Owns the scheduler, the executor that runs the model, and the request table."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        executor_class: type[Executor] | None = None,
    ) -> None:
        """executor_class: what runs the model; None = `executor_class_for(config)`."""
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        # What `auto` stands for (device, dtype, quantization): the same rules as `stallfree serve`'s.
        self.placement = resolve_placement(
            config.device,
            config.dtype,
            config.quantization,
            world_size=config.parallel.world_size,
            loaded=loaded,
        )
        self.device, self.dtype = self.placement.device, self.placement.dtype
        executor_class = executor_class or executor_class_for(config)
        # NOTE: with worker ranks the leader keeps the full weights on the CPU; each rank copies its slices.
        load_device = torch.device("cpu") if executor_class.weights_on_host else self.device
        self.loaded = loaded or load_model(
            config.model,
            dtype=self.dtype,
            device=load_device,
            load_format=config.load_format,
            seed=config.seed,
            max_model_len=config.max_model_len,
            quantization=self.placement.quantization,
        )
        mc = self.loaded.config
        self.model_config = mc
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        sched_cfg = replace(config.scheduler, max_model_len=self.max_model_len)
        # Why the engine can no longer run (its executor failed), or None; batches submitted, not collected.
        self.dead: str | None = None
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        args = (config, self.loaded, self.device, self.dtype, self._graph_config())
        self.executor = executor_class(*args)
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            # One KV sizing: as configured, else what fits on the executor's smallest rank.
            asked = config.cache.num_kv_blocks
            self.num_kv_blocks = self.executor.kv_capacity() if asked is None else asked
            self.block_manager = BlockManager(
                self.num_kv_blocks,
                config.cache.block_size,
                enable_prefix_caching=config.cache.enable_prefix_caching,
                salt=self._prefix_cache_salt(),
            )
            self.cost_model = make_cost_model(config.cost_model)
            self.scheduler = Scheduler(sched_cfg, self.block_manager, self.cost_model)
            self.executor.allocate(self.num_kv_blocks)
        except BaseException:
            self._finalizer()
            raise
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size)
        self.stats_listeners: list[StatsListener] = []
        self.clock: Callable[[], float] = time.monotonic
        self.last_stats: IterationStats | None = None
        par = config.parallel
        logger.info(
            "engine ready: model=%s device=%s dtype=%s quantization=%s threads=%d policy=%s budget=%d "
            "kv_blocks=%d x %d tokens, backend=%s, tp=%d pp=%d",
            self.loaded.name,
            self.device,
            self.dtype,
            self.placement.quantization,
            torch.get_num_threads(),
            sched_cfg.policy,
            sched_cfg.tunables.token_budget,
            self.num_kv_blocks,
            config.cache.block_size,
            self.executor.backend_name,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
        )

    def _prefix_cache_salt(self) -> str:
        """Everything besides the tokens that decides the K/V, at the root of every prefix-cache hash."""
        c = self.config
        return f"{self.loaded.name}|{c.model}|{c.load_format}|{c.seed}|{self.dtype}"

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (admin action); returns how many were dropped."""
        return self.block_manager.reset_prefix_cache()

    def _graph_config(self) -> GraphConfig | None:
        """The CUDA graphs to capture (the runner ignores them where the device or backend has none)."""
        if not self.config.cuda_graphs:
            return None
        return GraphConfig(
            self.config.scheduler.max_num_seqs, self.max_model_len, self.config.max_graph_tokens
        )

    # ---- requests -------------------------------------------------------------------------------------
    @property
    def tunables(self) -> SchedulerTunables:
        return self.scheduler.tunables

    def set_tunables(self, tunables: SchedulerTunables) -> None:
        """Change budget / chunk caps / limits; applies from the next iteration."""
        self.scheduler.tunables = tunables

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, ids: Sequence[int], params: SamplingParams) -> None:
        if params.structured_outputs is not None and not self.executor.supports_structured_outputs:
            raise ValueError(
                "structured outputs (response_format, guided_*, tool_choice required/named) are not "
                "supported with tensor or pipeline parallelism yet: serve the model on one device"
            )
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context (max_model_len) is "
                f"{self.max_model_len}, which must also hold at least one generated token: shorten the prompt"
            )
        need = blocks_needed(len(ids) + 1, self.block_manager.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"the prompt needs {need} KV-cache blocks but the cache has {self.num_kv_blocks}: "
                "shorten the prompt or give the KV cache more memory"
            )
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        traffic_cluster: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request. Raises ValueError with an actionable message for bad input, and
        ExecutorFailedError once the engine can no longer run."""
        self._check_alive()
        ids = self.tokenize(prompt)
        self.validate_prompt(ids, params)
        for t in params.stop_token_ids:
            if t >= self.model_config.vocab_size:
                raise ValueError(
                    f"stop token id {t} is outside the vocabulary (size {self.model_config.vocab_size})"
                )
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            traffic_cluster=traffic_cluster,
            priority=priority,
        )
        self.scheduler.add_request(req)
        if params.structured_outputs is not None:
            self.structured.add(request_id, params.structured_outputs)
        self.outputs.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its final output, or None if unknown/finished."""
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        return self._finalize(req)

    def check_health(self) -> None:
        """Raise ExecutorFailedError if the engine can no longer run: its executor failed, or a worker rank
        died while the engine was idle (the server's loop asks between steps)."""
        self._check_alive()
        try:
            self.executor.check_health()
        except ExecutorFailedError as e:
            self._die(str(e))
            raise

    def shutdown(self) -> None:
        """Stop the executor's worker ranks, if any (also done when the engine is garbage-collected)."""
        self._finalizer()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finalize(self, req: Request) -> RequestOutput:
        req.finish_time = self.clock()
        out = self.outputs.make_output(req)
        self.outputs.drop(req.request_id)
        self.executor.release(req.request_id)
        self.structured.release(req.request_id)
        return out

    # ---- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that produced a token, finished or failed.

        Schedules and submits batches until the executor holds `max_in_flight` of them (pipeline
        parallelism: one micro-batch per stage) or nothing else can run, then waits for the oldest and
        applies its tokens. Requests of a batch in flight sit out of scheduling until it comes back
        (Scheduler.in_flight), so none is in two at once. In process the depth is 1: schedule -> run ->
        update. Raises ExecutorFailedError when the executor can no longer run (every request then ends
        with that error).
        """
        self._check_alive()
        try:
            while len(self._in_flight) < self.executor.max_in_flight:
                t0 = time.perf_counter()
                sched = self.scheduler.schedule()  # a scheduler bug is not a failed forward: it propagates
                t_sched = time.perf_counter() - t0
                if sched.is_empty:
                    break
                self._mark_scheduled(sched)
                sched = self.structured.attach_masks(sched)  # filled in the background while the model runs
                self.scheduler.mark_in_flight(sched)
                self._in_flight.append((sched, t_sched))
                self._forward(self.executor.submit, sched)
            if not self._in_flight:
                return []
            run = self._forward(self.executor.collect)
        except _ForwardFailed as e:
            return self._fail_in_flight(str(e))
        sched, t_sched = self._in_flight.popleft()
        self.scheduler.complete(sched)
        return self._apply(sched, run, t_sched, time.perf_counter())

    def _mark_scheduled(self, sched) -> None:
        now = self.clock()
        for c in sched.chunks:
            req = self.scheduler.get(c.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now

    def _apply(self, sched, run, t_sched: float, t2: float) -> list[RequestOutput]:
        """Append the sampled tokens of one finished iteration (or micro-batch), finish requests, report."""
        now = self.clock()
        results: list[RequestOutput] = []
        for rid, res in run.samples.items():
            req = self.scheduler.get(rid)
            if req is None:
                continue
            status = self.outputs.append_token(req, res, now)
            if rid in self.structured:
                status = self._advance_grammar(req, res.token_id, status)
            if status is not None:
                self.scheduler.finish_request(rid, status)
                results.append(self._finalize(req))
            else:
                results.append(self.outputs.make_output(req))
        t3 = time.perf_counter()
        # NOTE: the stats' time is the step's end, after the update: the iteration log's period (end to
        # end) must cover the whole step it is compared with. Tokens keep `now`, when they were sampled.
        stats = self._stats(sched, run, t_sched, t3 - t2, self.clock())
        # The cost model learns what this iteration took (it predicted it before: the scheduler sized the
        # chunks with that prediction when the budget is a time).
        predicted = self.cost_model.observe(iteration_features(sched.chunks), stats.time_total)
        err = self.cost_model.error() if self.cost_model.observations % ERROR_EVERY == 1 else None
        stats = replace(
            stats,
            predicted_time=predicted,
            time_limit=sched.time_limit,
            cost_model_error=None if err is None else (err.median, err.p95),
        )
        self.last_stats = stats
        for listener in self.stats_listeners:
            listener(stats, results)
        return results

    def _advance_grammar(
        self, req: Request, token_id: int, status: RequestStatus | None
    ) -> RequestStatus | None:
        """Feed a constrained request's token to its grammar; it ends where the grammar has terminated."""
        if not self.structured.accept(req.request_id, token_id):
            # NOTE: cannot happen for a masked row; a sign of a vocabulary/grammar mismatch, so fail loudly.
            req.error = f"the sampled token {token_id} does not fit the request's grammar"
            logger.error("%s: %s", req.request_id, req.error)
            return RequestStatus.FINISHED_ERROR
        if status is None and self.structured.is_terminated(req.request_id):
            return RequestStatus.FINISHED_STOPPED
        return status

    def _forward(self, call, *args):
        """One executor call. ExecutorFailedError (the executor can no longer run) fails every request and
        is re-raised; any other exception is a failed forward pass (_ForwardFailed: its batches fail)."""
        try:
            return call(*args)
        except ExecutorFailedError as e:
            self._die(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the forward pass fails its requests, loudly
            raise _ForwardFailed(f"model execution failed: {type(e).__name__}: {e}") from e

    def _fail_in_flight(self, message: str) -> list[RequestOutput]:
        """A forward pass failed: fail the requests of every batch in flight (in process: the one batch)."""
        logger.exception("model forward failed; failing the requests of %d batch(es)", len(self._in_flight))
        outs = []
        while self._in_flight:
            sched, _ = self._in_flight.popleft()
            self.scheduler.complete(sched)
            for c in sched.chunks:
                req = self.scheduler.finish_request(c.request_id, RequestStatus.FINISHED_ERROR)
                if req is not None:
                    req.error = message
                    outs.append(self._finalize(req))
        return outs

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise ExecutorFailedError(self.dead)

    def _die(self, message: str) -> None:
        """The executor failed: fail every request still in the engine; later calls raise."""
        self.dead = message
        self._in_flight.clear()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            req.error = message
            self.outputs.drop(req.request_id)

    def _stats(self, sched, run, t_sched: float, t_update: float, now: float) -> IterationStats:
        prefill_by: dict[str, int] = {}
        decode_by: dict[str, int] = {}
        for c in sched.chunks:
            d = decode_by if c.is_decode else prefill_by
            d[c.traffic_cluster] = d.get(c.traffic_cluster, 0) + c.num_tokens
        n_dec = sum(1 for c in sched.chunks if c.is_decode)
        return IterationStats(
            time=now,
            token_budget=sched.token_budget,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_prefill_requests=len(sched.chunks) - n_dec,
            num_decode_requests=n_dec,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(sched.preempted),
            kv_usage=self.block_manager.usage,
            time_schedule=t_sched,
            time_prepare=run.time_prepare,
            time_forward=run.time_forward,
            time_sample=run.time_sample,
            time_update=t_update,
            prefill_tokens_by_cluster=prefill_by,
            decode_tokens_by_cluster=decode_by,
            chunk_shapes=tuple((c.num_tokens, c.start, c.is_decode) for c in sched.chunks),
            prefix_cache=sched.prefix_cache,
            num_cached_blocks=self.block_manager.num_cached_blocks,
        )


def make_cost_model(path: str | None) -> OnlineCostModel:
    """The engine's calibrated iteration cost model: a `stallfree profile` fit as its prior, or the
    conservative built-in prior (stallfree.costmodel.calibrate)."""
    if path is None:
        return OnlineCostModel()
    fit = FittedCostModel.load(path)
    return OnlineCostModel(fit.coefficients, gemm_knee=fit.gemm_knee)


def executor_class_for(config: EngineConfig) -> type[Executor]:
    """In this process at T x P = 1, else over worker ranks (started when the engine is made)."""
    if config.parallel.world_size == 1:
        return InProcessExecutor
    from stallfree.engine.parallel.executor import ParallelExecutor  # noqa: PLC0415 - only when asked for

    return ParallelExecutor


def create_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> LLMEngine:
    """The engine for `config`: its model runs in this process, or over worker ranks when T x P > 1."""
    return LLMEngine(config, loaded=loaded)
