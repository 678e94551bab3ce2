"""The engine over T x P worker ranks: the same scheduler and output handling, a pipelined step.

`step()` keeps up to `pipeline_parallel_size` micro-batches in flight: it schedules and submits until the
pipeline is full (or nothing else can run), then waits for the oldest one and applies its tokens. Requests
of a micro-batch in flight are invisible to the scheduler until it comes back (Scheduler.in_flight), so no
request is ever in two micro-batches at once. With P = 1 this is schedule -> run -> update, as in LLMEngine.

A worker failure is fatal: every request still in the engine ends with an explicit error, `dead` says
why, and step() / add_request raise `WorkerFailedError` from then on (the server's engine loop turns that
into error responses and a not-ready /ready).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque

from stallfree.engine.attention import resolve_attention_backend
from stallfree.engine.config import EngineConfig
from stallfree.engine.engine import LLMEngine, resolve_device, resolve_dtype
from stallfree.engine.model.loader import LoadedModel, load_model
from stallfree.engine.outputs import RequestOutput
from stallfree.engine.parallel.env import NodeContract, read_contract
from stallfree.engine.parallel.executor import ParallelExecutor, WorkerFailedError, share_weights
from stallfree.engine.parallel.layers import head_shard
from stallfree.engine.parallel.stage import stage_layers
from stallfree.engine.parallel.worker import WorkerInit
from stallfree.engine.request import RequestStatus
from stallfree.ports import free_port

logger = logging.getLogger(__name__)


class _BackendName:
    """What the engine's start-up log reads: the backend every rank runs, and the layout."""

    def __init__(self, name: str) -> None:
        self.name = name


class ParallelLLMEngine(LLMEngine):
    """LLMEngine whose model runs in tensor/pipeline-parallel worker processes."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, contract: NodeContract | None = None
    ) -> None:
        self._contract = contract or read_contract()
        self.dead: str | None = None
        self._in_flight: deque[tuple[object, float]] = deque()
        self.executor: ParallelExecutor | None = None
        if loaded is None:  # NOTE: the leader keeps the full weights on the CPU; ranks copy their slices
            dtype = resolve_dtype(config.dtype, resolve_device(config.device))
            loaded = load_model(
                config.model, dtype=dtype, device="cpu", load_format=config.load_format, seed=config.seed,
                max_model_len=config.max_model_len,
            )  # fmt: skip
        try:
            super().__init__(config, loaded)
        except BaseException:
            if self.executor is not None:
                self.executor.shutdown()
            raise
        self._finalizer = weakref.finalize(self, self.executor.shutdown)

    # ---- construction hooks ------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        """Start the workers (they report how many blocks fit on each rank); the cache is the smallest."""
        par, mc = self.config.parallel, self.model_config
        stage_layers(mc.num_layers, par.pipeline_parallel_size, 0)  # validate P before spawning anything
        head_shard(mc.num_heads, mc.num_kv_heads, par.tensor_parallel_size, par.tensor_parallel_size - 1)
        contract = self._contract
        on_cuda = self.device.type == "cuda"
        single = contract.num_nodes == 1
        cache = self.config.cache
        template = WorkerInit(
            rank=0,
            tp_size=par.tensor_parallel_size,
            pp_size=par.pipeline_parallel_size,
            init_method=f"tcp://127.0.0.1:{free_port()}" if single else contract.init_method,
            backend="nccl" if on_cuda else "gloo",
            device="cuda" if on_cuda else "cpu",
            dtype=self.dtype,
            model_config=mc,
            state=share_weights(self.loaded.model),
            model_path=self.config.model,
            load_format=self.config.load_format,
            block_size=cache.block_size,
            # NOTE: resolved here, once, so every rank runs the same backend
            attention_backend=resolve_attention_backend(
                self.config.attention_backend, self.device, self.dtype
            ),
            kv_cache_bytes=None if cache.kv_cache_memory_gb is None else cache.kv_cache_memory_gb * 2**30,
            stop_token_ids=self.tokenizer.stop_token_ids,
            seed=self.config.seed,
            timeout_s=par.step_timeout_s,
            graphs=self._graph_config(),
        )
        self.executor = ParallelExecutor(template, contract)
        fits = min(self.executor.capacities.values())
        if cache.num_kv_blocks is not None:
            if cache.num_kv_blocks > fits:
                self.executor.shutdown()
                raise ValueError(
                    f"num_kv_blocks {cache.num_kv_blocks} does not fit: a rank holds at most {fits}"
                )
            return cache.num_kv_blocks
        return fits

    def _make_runner(self):  # type: ignore[override]
        assert self.executor is not None
        seconds = self.executor.allocate(self.num_kv_blocks)
        if seconds:
            logger.info("worker ranks warmed up in %.1f s", seconds)
        self.executor.backend = _BackendName(  # type: ignore[attr-defined]
            f"{self.executor.template.attention_backend} x tp{self.config.parallel.tensor_parallel_size}"
            f" x pp{self.config.parallel.pipeline_parallel_size}"
        )
        return self.executor

    # ---- the pipelined loop ------------------------------------------------------------------------
    @property
    def pipeline_depth(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def validate_prompt(self, ids, params) -> None:  # type: ignore[override]
        if params.structured_outputs is not None:
            raise ValueError(
                "structured outputs (response_format, guided_*, tool_choice required/named) are not "
                "supported with tensor or pipeline parallelism yet: serve the model on one device"
            )
        super().validate_prompt(ids, params)

    def add_request(self, request_id, prompt, params, **kw):  # type: ignore[override]
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        return super().add_request(request_id, prompt, params, **kw)

    def step(self) -> list[RequestOutput]:
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        try:
            while len(self._in_flight) < self.pipeline_depth:
                t0 = time.perf_counter()
                sched = self.scheduler.schedule()
                if sched.is_empty:
                    break
                self._mark_scheduled(sched)
                self.scheduler.mark_in_flight(sched)
                self.runner.submit(sched)
                self._in_flight.append((sched, time.perf_counter() - t0))
            if not self._in_flight:
                return []
            run = self.runner.collect()
        except WorkerFailedError as e:
            self._die(str(e))
            raise
        sched, t_sched = self._in_flight.popleft()
        self.scheduler.complete(sched)
        return self._apply(sched, run, t_sched, time.perf_counter())

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker died while the engine was idle (the server's loop asks)."""
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        try:
            self.runner.check_health()
        except WorkerFailedError as e:
            self._die(str(e))
            raise

    def _die(self, message: str) -> None:
        """Fail every request still in the engine; later calls raise."""
        self.dead = message
        self._in_flight.clear()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            req.error = message
            self.outputs.drop(req.request_id)

    def shutdown(self) -> None:
        """Stop the worker processes (also done when the engine is garbage-collected or at exit)."""
        self._finalizer()
