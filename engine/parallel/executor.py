"""The leader's side of the workers: start them, send them micro-batches, collect tokens, notice deaths.

On one host every rank is a spawned process with a pipe to the leader and the leader's weights in shared
memory (no rank reads the model file again). Across nodes, the other pods' ranks connect to the leader's
control port (see env.py) and load the model themselves.

Failure: while waiting for a micro-batch the leader watches every rank's connection and (on its own host)
every process sentinel, with a deadline of `step_timeout_s`. A rank that exits, closes its connection,
reports an error or stays silent past the deadline raises `WorkerFailedError` within about
`POLL_S` seconds of being noticed; the executor then stops every local rank (terminate, then kill).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import replace
from multiprocessing.connection import Client, Connection, Listener, wait

import torch
import torch.multiprocessing as mp

from stallfree.engine.attention import resolve_attention_backend
from stallfree.engine.config import EngineConfig
from stallfree.engine.executor import ExecutorFailedError, kv_budget_bytes
from stallfree.engine.model.loader import LoadedModel
from stallfree.engine.model_runner import GraphConfig, RunnerOutput
from stallfree.engine.parallel.env import NodeContract, read_contract
from stallfree.engine.parallel.layers import head_shard
from stallfree.engine.parallel.stage import stage_layers
from stallfree.engine.parallel.worker import WorkerInit, worker_main
from stallfree.engine.scheduler import SchedulerOutput
from stallfree.ports import free_port

logger = logging.getLogger(__name__)

POLL_S = 0.2
STOP_GRACE_S = 3.0


class WorkerFailedError(ExecutorFailedError):
    """A tensor/pipeline-parallel worker died, failed or stopped answering: the engine cannot continue."""


def worker_init(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    graphs: GraphConfig | None,
) -> WorkerInit:
    """What every rank starts from (rank 0's copy); ValueError for a layout the model cannot take."""
    par, mc = config.parallel, loaded.config
    stage_layers(mc.num_layers, par.pipeline_parallel_size, 0)  # validate P before spawning anything
    head_shard(mc.num_heads, mc.num_kv_heads, par.tensor_parallel_size, par.tensor_parallel_size - 1)
    contract = read_contract()
    on_cuda = device.type == "cuda"
    return WorkerInit(
        rank=0,
        tp_size=par.tensor_parallel_size,
        pp_size=par.pipeline_parallel_size,
        init_method=f"tcp://127.0.0.1:{free_port()}" if contract.num_nodes == 1 else contract.init_method,
        backend="nccl" if on_cuda else "gloo",
        device="cuda" if on_cuda else "cpu",
        dtype=dtype,
        model_config=mc,
        state=share_weights(loaded.model),
        model_path=config.model,
        load_format=config.load_format,
        block_size=config.cache.block_size,
        # NOTE: resolved here, once, so every rank runs the same backend
        attention_backend=resolve_attention_backend(config.attention_backend, device, dtype),
        kv_cache_bytes=kv_budget_bytes(config.cache),
        stop_token_ids=loaded.tokenizer.stop_token_ids,
        seed=config.seed,
        timeout_s=par.step_timeout_s,
        graphs=graphs,
    )


class ParallelExecutor:
    """The engine's executor over the T x P worker ranks of one replica (stallfree.engine.executor's
    protocol): every micro-batch goes to every rank; up to P of them are in flight, one per stage."""

    supports_structured_outputs = False  # NOTE: grammar masks are filled by a thread of the leader
    weights_on_host = True  # shared with the local ranks, which copy their slices

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        graphs: GraphConfig | None,
        start_timeout_s: float = 600.0,
    ) -> None:
        """Check the layout, then start this node's ranks (the rank contract comes from the environment:
        parallel.env); they take their slices of the leader's weights (`loaded`, on the CPU, in shared
        memory) and report how many KV blocks fit on each."""
        template = worker_init(config, loaded, device, dtype, graphs)
        contract = read_contract()
        self.template = template
        self.backend_name = template.attention_backend
        self.max_in_flight = template.pp_size
        self.start_timeout_s = start_timeout_s
        self.world = template.world_size
        self.sampling_rank = (template.pp_size - 1) * template.tp_size
        self.conns: dict[int, Connection] = {}
        self.procs: dict[int, mp.Process] = {}
        self._released: list[str] = []
        self._next_mb = 0
        self._in_flight: deque[int] = deque()
        self._listener: Listener | None = None
        self.dead: str | None = None
        ctx = mp.get_context("spawn")
        try:
            for rank in contract.ranks(self.world):
                parent, child = ctx.Pipe()
                init = replace(template, rank=rank, device=self._device(rank, contract))
                p = ctx.Process(
                    target=worker_main,
                    args=(child, init, os.getpid()),
                    name=f"stallfree-rank{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                self.conns[rank], self.procs[rank] = parent, p
            if contract.num_nodes > 1:
                self._accept_remote(contract, start_timeout_s)
            self.capacities = self._gather("ready", start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d worker ranks (tp=%d, pp=%d)", self.world, template.tp_size, template.pp_size)

    def _device(self, rank: int, contract: NodeContract) -> str:
        if self.template.device.startswith("cuda"):
            return f"cuda:{rank % contract.ranks_per_node(self.world)}"
        return self.template.device

    def _accept_remote(self, contract: NodeContract, timeout_s: float) -> None:
        """Wait for the other nodes' ranks to connect; send each its WorkerInit (no shared weights)."""
        self._listener = Listener(("0.0.0.0", contract.control_port), authkey=contract.authkey)
        sock = self._listener._listener._socket  # noqa: SLF001 - a deadline on accept()
        sock.settimeout(timeout_s)
        remote = set(range(self.world)) - set(self.conns)
        while remote:
            try:
                conn = self._listener.accept()
            except TimeoutError as e:
                raise WorkerFailedError(
                    f"ranks {sorted(remote)} did not connect within {timeout_s:.0f} s"
                ) from e
            _, rank = conn.recv()
            if rank not in remote:
                conn.close()
                continue
            conn.send(replace(self.template, rank=rank, state=None))
            self.conns[rank] = conn
            remote.discard(rank)

    # ---- protocol ----------------------------------------------------------------------------------
    def kv_capacity(self) -> int:
        """KV blocks that fit on every rank (each measured its own, after taking its weights)."""
        return min(self.capacities.values())

    def allocate(self, num_blocks: int) -> float:
        """Every rank allocates its cache and warms its runner up; returns the slowest warm-up in seconds."""
        fits = self.kv_capacity()
        if num_blocks > fits:
            raise ValueError(f"num_kv_blocks {num_blocks} does not fit: a rank holds at most {fits}")
        self._broadcast(("alloc", num_blocks))
        seconds = max(self._gather("warm", self.start_timeout_s).values())
        if seconds:
            logger.info("worker ranks warmed up in %.1f s (%s)", seconds, self.backend_name)
        return seconds

    def release(self, request_id: str) -> None:
        self._released.append(request_id)

    def submit(self, sched: SchedulerOutput) -> None:
        """Send one micro-batch to every rank (the leader's broadcast of its scheduling decision)."""
        mb = self._next_mb
        self._next_mb += 1
        released, self._released = tuple(self._released), []
        self._broadcast(("step", mb, sched, released))
        self._in_flight.append(mb)

    def collect(self) -> RunnerOutput:
        """Wait for the oldest in-flight micro-batch's sampled tokens."""
        mb = self._in_flight.popleft()
        kind, got, samples, (t_prep, t_fwd, t_sample) = self._wait_for("done", self.template.timeout_s)
        if got != mb:
            raise self._fail(f"micro-batch {got} came back while {mb} was expected")
        return RunnerOutput(samples, t_prep, t_fwd, t_sample)

    def stats(self) -> dict[int, list]:
        """Every rank's (micro-batch, tokens, start, compute start, compute end, end) records (monotonic s)."""
        self._broadcast(("stats",))
        return self._gather("stats", self.template.timeout_s)

    def check_health(self) -> None:
        """Between steps: raise WorkerFailedError if a rank exited or said something unasked (an error)."""
        self._check()
        for rank, p in self.procs.items():
            if not p.is_alive():
                raise self._fail(self._death(rank, "died"))
        for rank, conn in self.conns.items():
            if conn.poll():
                try:
                    msg = conn.recv()
                except (EOFError, OSError) as e:
                    raise self._fail(self._death(rank, f"closed its connection ({type(e).__name__})")) from e
                raise self._fail(msg[2] if msg[0] == "error" else f"unexpected {msg[0]!r} from rank {rank}")

    # ---- plumbing ----------------------------------------------------------------------------------
    def _broadcast(self, msg) -> None:
        self._check()
        for rank, conn in self.conns.items():
            try:
                conn.send(msg)
            except (OSError, EOFError) as e:
                raise self._fail(self._death(rank, f"is unreachable ({type(e).__name__})")) from e
            except Exception as e:  # noqa: BLE001 - e.g. unpicklable: the ranks that got it would run ahead
                raise self._fail(f"could not send {msg[0]!r} to rank {rank}: {type(e).__name__}: {e}") from e

    def _gather(self, kind: str, timeout_s: float) -> dict:
        out: dict = {}
        while len(out) < len(self.conns):
            msg = self._wait_for(kind, timeout_s, exclude=set(out))
            out[msg[1]] = msg[2]
        return out

    def _wait_for(self, kind: str, timeout_s: float, exclude: set[int] = frozenset()):  # type: ignore[assignment]
        deadline = time.monotonic() + timeout_s
        by_obj: dict = {c: r for r, c in self.conns.items() if r not in exclude}
        by_obj.update({p.sentinel: r for r, p in self.procs.items()})
        while True:
            self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no {kind!r} answer from the workers within {timeout_s:.0f} s")
            for obj in wait(list(by_obj), timeout=min(POLL_S, left)):
                rank = by_obj[obj]
                if not isinstance(obj, Connection):
                    if rank in self.conns and self.conns[rank].poll():
                        obj = self.conns[rank]  # read its last words (an error report) first
                    else:
                        self.procs[rank].join(1.0)  # reap it, so its exit code is known
                        code = self.procs[rank].exitcode
                        raise self._fail(
                            f"worker rank {rank} (pid {self.procs[rank].pid}) died, exit code {code}"
                        )
                try:
                    msg = obj.recv()
                except (EOFError, OSError) as e:
                    # The connection can break before the process sentinel fires: reap it and name the death.
                    raise self._fail(self._death(rank, f"closed its connection ({type(e).__name__})")) from e
                if msg[0] == "error":
                    raise self._fail(self._root_cause(rank, msg[2]))
                if msg[0] == kind:
                    return msg
                logger.warning("ignoring unexpected %r message from rank %d", msg[0], rank)

    def _root_cause(self, reporter: int, error: str) -> str:
        """A rank's error is often the echo of a peer's death (gloo: connection reset): name the dead peer."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, p in self.procs.items():
                if rank != reporter and not p.is_alive():
                    first = error.strip().splitlines()[0]
                    return f"{self._death(rank, 'died')} (then rank {reporter}: {first})"
            time.sleep(0.05)
        return error

    def _death(self, rank: int, what: str) -> str:
        p = self.procs.get(rank)
        if p is None:
            return f"worker rank {rank} (on another node) {what}"
        p.join(1.0)  # reap it, so its exit code is known
        if p.exitcode is None:
            return f"worker rank {rank} (pid {p.pid}) {what}"
        return f"worker rank {rank} (pid {p.pid}) died, exit code {p.exitcode}"

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerFailedError(self.dead)

    def _fail(self, message: str) -> WorkerFailedError:
        self.dead = f"a parallel worker failed: {message}"
        logger.error("%s; stopping all %d ranks", self.dead, self.world)
        self.shutdown()
        return WorkerFailedError(self.dead)

    def shutdown(self) -> None:
        """Stop every rank: ask politely, then terminate, then kill (bounded by about 2 x STOP_GRACE_S)."""
        for conn in self.conns.values():
            try:
                conn.send(("shutdown",))
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for conn in self.conns.values():
            conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.procs.clear()
        self.conns.clear()


def run_remote_ranks(contract: NodeContract, world_size: int) -> int:
    """A non-leader pod: start this node's ranks, which fetch their WorkerInit from the leader.

    Returns when every local rank has exited (0 if all exited cleanly).
    """
    ctx = mp.get_context("spawn")
    procs = []
    for rank in contract.ranks(world_size):
        p = ctx.Process(target=remote_worker_main, args=(contract, rank), name=f"stallfree-rank{rank}")
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    return max((abs(p.exitcode or 0) for p in procs), default=0)


def remote_worker_main(contract: NodeContract, rank: int, connect_timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = Client((contract.leader_address, contract.control_port), authkey=contract.authkey)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    conn.send(("hello", rank))
    init = conn.recv()
    if init.device.startswith("cuda"):
        init = replace(init, device=f"cuda:{rank % contract.ranks_per_node(init.world_size)}")
    worker_main(conn, init)


def share_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's state dict with every tensor moved to shared memory (in place: no copy kept)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for t in state.values():
        t.share_memory_()
    return state
