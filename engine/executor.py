"""How the engine runs its model: the executor protocol, the in-process executor, and the one KV sizing rule.

`LLMEngine.step` hands every scheduled batch to an executor and takes the sampled tokens back (vLLM V1's
`Executor` under its `EngineCore`). Two implement the protocol:
- `InProcessExecutor`: one `ModelRunner` in this process, on one device;
- `stallfree.engine.parallel.executor.ParallelExecutor`: T x P worker ranks, each running its share of the
  model with the same `ModelRunner`; it holds up to P micro-batches in flight (one per pipeline stage).

Start-up is the same three steps for both: the engine makes the executor (a parallel one starts its workers,
which take their weights), asks `kv_capacity()` how many KV blocks fit (on the smallest rank), chooses the
cache size and calls `allocate(num_blocks)`, which builds the caches and warms the runners up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from stallfree.engine.attention import FALLBACK, KVCache, make_backend, resolve_attention_backend
from stallfree.engine.config import CacheConfig, EngineConfig
from stallfree.engine.model.loader import LoadedModel
from stallfree.engine.model_runner import GraphConfig, ModelRunner, RunnerOutput
from stallfree.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache of one engine (or rank) on the CPU, unless configured
CUDA_KV_CACHE_FRACTION = 0.5  # of the device memory free after the weights, unless configured


class ExecutorFailedError(RuntimeError):
    """The executor can no longer run (a worker rank died, failed or stopped answering): the engine fails
    every request it holds and refuses new ones."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one rank's KV cache holds per block: its layers (a pipeline stage's), its KV heads (a tensor
    shard's) and the element type."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block across this rank's layers: 2 * layers * nkv * hd * block size * element size."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * elt

    def make_cache(self, num_blocks: int, device: torch.device) -> KVCache:
        """This rank's KV cache of `num_blocks` blocks."""
        return KVCache(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, device
        )


def kv_budget_bytes(cache: CacheConfig) -> float | None:
    """The configured KV cache per rank in bytes, or None for the device's default (see kv_cache_blocks)."""
    return None if cache.kv_cache_memory_gb is None else cache.kv_cache_memory_gb * 2**30


def kv_cache_blocks(shape: KVShape, device: torch.device, budget_bytes: float | None) -> int:
    """How many KV blocks of `shape` fit in `budget_bytes`, or by default in CPU_KV_CACHE_BYTES on the CPU or
    CUDA_KV_CACHE_FRACTION of the free memory on a CUDA device (measured after the weights are in place)."""
    if budget_bytes is None:
        if device.type == "cuda":
            budget_bytes = torch.cuda.mem_get_info(device)[0] * CUDA_KV_CACHE_FRACTION
        else:
            budget_bytes = CPU_KV_CACHE_BYTES
    return max(1, int(budget_bytes // shape.block_bytes))


class Executor(Protocol):
    """What the engine's step needs from whatever runs the model."""

    backend_name: str  # the attention backend every rank runs (resolved: never auto)
    max_in_flight: int  # micro-batches it holds at once: 1 in process, P with P pipeline stages
    supports_structured_outputs: bool  # whether grammar masks can travel with a batch
    weights_on_host: bool  # the engine loads the full weights on the CPU (ranks copy their slices from them)

    def kv_capacity(self) -> int:
        """KV blocks that fit on every rank (the smallest rank's count)."""
        ...

    def allocate(self, num_blocks: int) -> float:
        """Build every rank's KV cache of `num_blocks` and warm its runner up; returns the warm-up seconds.
        Raises ValueError when that many blocks do not fit."""
        ...

    def submit(self, sched: SchedulerOutput) -> None:
        """Start one batch (a micro-batch, with pipeline stages)."""
        ...

    def collect(self) -> RunnerOutput:
        """The sampled tokens of the oldest submitted batch. Raises ExecutorFailedError when the executor
        cannot go on; any other exception fails only that batch's requests."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request's per-request state (its sampler's generator)."""
        ...

    def check_health(self) -> None:
        """Between steps: raise ExecutorFailedError when a rank died, also while the engine is idle."""
        ...

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        ...


class InProcessExecutor:
    """One ModelRunner in this process: `submit` keeps the batch, `collect` runs it."""

    max_in_flight = 1
    supports_structured_outputs = True
    weights_on_host = False

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        graphs: GraphConfig | None,
    ) -> None:
        """The attention backend is resolved here, for this device and dtype (`auto` included)."""
        self.config, self.loaded, self.device, self.graphs = config, loaded, device, graphs
        self.backend_name = resolve_attention_backend(config.attention_backend, device, dtype)
        mc, cache = loaded.config, config.cache
        self.shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, cache.block_size, dtype)
        self.runner: ModelRunner | None = None
        self._pending: SchedulerOutput | None = None

    def kv_capacity(self) -> int:
        return kv_cache_blocks(self.shape, self.device, kv_budget_bytes(self.config.cache))

    def allocate(self, num_blocks: int) -> float:
        """Build the runner and warm it up (kernels compiled, CUDA graphs captured). If `auto` chose the
        backend and it cannot build its kernels, say so once and use the fallback backend (torch) instead."""
        try:
            self.runner = self._runner(self.backend_name, num_blocks)
            seconds = self.runner.warm_up()
        except Exception as e:  # noqa: BLE001 - any kernel build failure: fall back, loudly, once
            if self.config.attention_backend != "auto" or self.backend_name == FALLBACK:
                raise
            logger.warning(
                "the %s attention backend could not build its kernels (%s: %s); using the %s backend",
                self.backend_name, type(e).__name__, e, FALLBACK,
            )  # fmt: skip
            self.runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.backend_name = FALLBACK
            self.runner = self._runner(FALLBACK, num_blocks)
            return 0.0
        if seconds:
            logger.info("runner warmed up in %.1f s (%s)", seconds, self.backend_name)
        return seconds

    def _runner(self, backend: str, num_blocks: int) -> ModelRunner:
        mc = self.loaded.config
        kv = self.shape.make_cache(num_blocks, self.device)
        return ModelRunner(
            self.loaded.model,
            make_backend(backend, kv, mc.num_heads, mc.num_kv_heads, mc.head_dim),
            stop_token_ids=self.loaded.tokenizer.stop_token_ids,
            seed=self.config.seed,
            graphs=self.graphs,
        )

    def submit(self, sched: SchedulerOutput) -> None:
        assert self._pending is None, "the in-process executor holds one batch at a time"
        self._pending = sched

    def collect(self) -> RunnerOutput:
        assert self.runner is not None and self._pending is not None
        sched, self._pending = self._pending, None
        return self.runner.execute(sched)

    def release(self, request_id: str) -> None:
        if self.runner is not None:
            self.runner.release(request_id)

    def check_health(self) -> None:
        """Nothing can die apart from this process."""

    def shutdown(self) -> None:
        """Nothing to stop."""
