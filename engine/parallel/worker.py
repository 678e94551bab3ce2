"""A rank process: its share of the model (one pipeline stage, one tensor-parallel slice), its slice of the
KV cache, and a loop that runs every micro-batch the leader sends.

Control messages (pickled over a multiprocessing connection, in this order on every worker):
  leader -> worker  WorkerInit, then ("alloc", num_blocks), then ("step", mb, SchedulerOutput, released ids),
                    ("stats",) or ("shutdown",)
  worker -> leader  ("ready", rank, kv capacity in blocks); ("warm", rank, seconds) once its runner has
                    compiled its kernels and captured its CUDA graphs; ("done", mb, samples, timings) from the
                    sampling rank (last stage, tensor rank 0); ("stats", rank, records); ("error", rank, message)
Tensors move between ranks only through torch.distributed: all-reduce / all-gather inside a stage's
tensor-parallel group, hidden states from stage s to stage s + 1 (same tensor rank) by send/recv.

NOTE: every worker receives the same micro-batches in the same order, and every stage runs them in that
order; that FIFO rule is what makes the pipeline's KV writes and hidden-state hand-offs line up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import Tensor

from stallfree.engine.attention import make_backend
from stallfree.engine.executor import KVShape, kv_cache_blocks
from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model_runner import GraphConfig, ModelRunner
from stallfree.engine.parallel.layers import Collective, NoCollective, head_shard
from stallfree.engine.parallel.stage import build_stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInit:
    rank: int
    tp_size: int
    pp_size: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500
    backend: str  # gloo (CPU) or nccl (CUDA)
    device: str  # cpu, or cuda:<local rank>
    dtype: torch.dtype
    model_config: LlamaConfig
    state: dict[str, Tensor] | None  # full weights in shared memory (same host), or None: load model_path
    model_path: str | None
    block_size: int
    attention_backend: str  # resolved by the leader (never auto): every rank runs the same backend
    kv_cache_bytes: float | None  # per rank; None = the device's default (executor.kv_cache_blocks)
    stop_token_ids: frozenset[int]
    seed: int
    timeout_s: float
    # How a rank without shared weights (another node) gets them: "auto" reads model_path; "dummy" builds
    # the same random weights as the leader (same shape, dtype and seed, on the CPU, so they agree).
    load_format: str = "auto"
    # CUDA graphs of this rank's stage (ignored unless the backend supports them on a CUDA device); every
    # rank captures the same sizes in the same order, so the collectives inside the captures line up.
    graphs: GraphConfig | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


class DistCollective:
    """The tensor-parallel group of one pipeline stage over torch.distributed."""

    def __init__(self, group, size: int) -> None:
        self.group, self.size = group, size

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _init_distributed(init: WorkerInit) -> Collective:
    dist.init_process_group(
        init.backend,
        init_method=init.init_method,
        rank=init.rank,
        world_size=init.world_size,
        timeout=timedelta(seconds=init.timeout_s),
    )
    comm: Collective = NoCollective()
    if init.tp_size > 1:
        for s in range(init.pp_size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(s * init.tp_size, (s + 1) * init.tp_size)))
            if s == init.stage:
                comm = DistCollective(group, init.tp_size)
    return comm


class PipeLink:
    """A stage's hand-offs: hidden states from the previous stage (same tensor rank) and to the next one."""

    def __init__(self, init: WorkerInit, stage: LlamaForCausalLM, device: torch.device) -> None:
        self.init, self.device = init, device
        self.last = stage.last_stage
        self.prev = init.rank - init.tp_size if not stage.first_stage else None
        self.next = init.rank + init.tp_size if not stage.last_stage else None
        self._pending_send: tuple[object, Tensor] | None = None

    def receive(self, num_tokens: int) -> Tensor | None:
        if self.prev is None:
            return None
        cfg = self.init.model_config
        x = torch.empty(num_tokens, cfg.hidden_size, dtype=self.init.dtype, device=self.device)
        dist.recv(x, self.prev)  # (T, C) from the previous stage
        return x

    def send(self, hidden: Tensor) -> None:
        # One send in flight: wait for the previous one before posting the next (keeps its buffer alive).
        if self._pending_send is not None:
            self._pending_send[0].wait()
        self._pending_send = (dist.isend(hidden.contiguous(), self.next), hidden)


class StageWorker:
    """Runs micro-batches through this rank's stage with the one model runner; the sampling rank returns
    the sampled tokens."""

    def __init__(self, init: WorkerInit, stage: LlamaForCausalLM, device: torch.device) -> None:
        self.init, self.stage, self.device = init, stage, device
        cfg = init.model_config
        hs = head_shard(cfg.num_heads, cfg.num_kv_heads, init.tp_size, init.tp_rank)
        self.num_heads, self.num_kv_heads = len(hs.q_heads), len(hs.kv_heads)
        self.samples = stage.last_stage and init.tp_rank == 0
        # this rank's cache: its stage's layers, its shard's KV heads
        self.kv_shape = KVShape(
            stage.num_layers, self.num_kv_heads, cfg.head_dim, init.block_size, init.dtype
        )
        self.runner: ModelRunner | None = None
        # (mb, tokens, start, compute start, compute end, end), monotonic seconds; for the bubble figures
        self.records: list[tuple[int, int, float, float, float, float]] = []

    def capacity(self) -> int:
        """KV blocks that fit on this rank (the engine's one rule, over this rank's share)."""
        return kv_cache_blocks(self.kv_shape, self.device, self.init.kv_cache_bytes)

    def allocate(self, num_blocks: int) -> None:
        init, cfg = self.init, self.init.model_config
        cache = self.kv_shape.make_cache(num_blocks, self.device)
        backend = make_backend(init.attention_backend, cache, self.num_heads, self.num_kv_heads, cfg.head_dim)
        self.runner = ModelRunner(
            self.stage, backend, stop_token_ids=init.stop_token_ids, seed=init.seed, graphs=init.graphs,
            link=PipeLink(init, self.stage, self.device), samples=self.samples,
        )  # fmt: skip

    def warm_up(self) -> float:
        """Compile kernels and capture graphs (every rank at once: the warm-up batch crosses the stages)."""
        assert self.runner is not None
        return self.runner.warm_up()

    def run(self, mb: int, sched, released: tuple[str, ...]):
        """Run one micro-batch through this stage. Returns (samples, timings) on the last stage."""
        assert self.runner is not None
        t0 = time.monotonic()
        for rid in released:
            self.runner.release(rid)
        out = self.runner.execute(sched)
        t1 = t0 + out.time_prepare
        tc = t1 + out.time_forward
        if not self.stage.last_stage:
            self.records.append((mb, sched.num_tokens, t0, t1, tc, time.monotonic()))
            return None
        t3 = tc + out.time_sample
        self.records.append((mb, sched.num_tokens, t0, t1, t3, t3))
        return out.samples, (out.time_prepare, out.time_forward, out.time_sample)


def _watch_parent(parent: int) -> None:
    """Exit when the leader process is gone, even if this rank is stuck in a collective."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(conn: Connection, init: WorkerInit, parent_pid: int | None = None) -> None:
    """Entry point of a rank process (spawned by the executor, or by `run_node` on another node)."""
    torch.set_num_threads(1)  # NOTE: one thread per rank; more stall on a shared CPU
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        worker = _start(conn, init)
    except Exception as e:  # noqa: BLE001 - reported to the leader, which fails loudly
        _report(conn, init.rank, f"worker rank {init.rank} failed to start: {type(e).__name__}: {e}")
        return
    _loop(conn, init, worker)


def _start(conn: Connection, init: WorkerInit) -> StageWorker:
    device = torch.device(init.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = _init_distributed(init)
    state = init.state
    if state is None:
        from stallfree.engine.model.loader import load_model

        state = load_model(
            init.model_path, dtype=init.dtype, device="cpu", load_format=init.load_format, seed=init.seed,
            max_model_len=init.model_config.max_position_embeddings,
        ).model.state_dict()  # fmt: skip
    stage = build_stage(
        init.model_config, state, tp_size=init.tp_size, tp_rank=init.tp_rank, pp_size=init.pp_size,
        stage=init.stage, comm=comm, device=device, dtype=init.dtype,
    )  # fmt: skip
    del state
    worker = StageWorker(init, stage, device)
    conn.send(("ready", init.rank, worker.capacity()))
    kind, num_blocks = conn.recv()
    if kind != "alloc":
        raise RuntimeError(f"expected an alloc message, got {kind!r}")
    worker.allocate(num_blocks)
    conn.send(("warm", init.rank, worker.warm_up()))
    return worker


def _loop(conn: Connection, init: WorkerInit, worker: StageWorker) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # the leader is gone
        kind = msg[0]
        if kind == "shutdown":
            break
        if kind == "stats":
            conn.send(("stats", init.rank, list(worker.records)))
            continue
        _, mb, sched, released = msg
        try:
            out = worker.run(mb, sched, released)
        except Exception as e:  # noqa: BLE001 - the leader turns this into an engine failure
            _report(
                conn, init.rank, f"worker rank {init.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            )
            os._exit(1)  # peers blocked on this rank are killed by the leader
        if out is not None and worker.samples:
            conn.send(("done", mb, out[0], out[1]))
    if dist.is_initialized():
        dist.destroy_process_group()


def _report(conn: Connection, rank: int, message: str) -> None:
    try:
        conn.send(("error", rank, message))
    except (OSError, EOFError):
        pass
