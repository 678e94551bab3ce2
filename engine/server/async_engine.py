"""AsyncEngine: one dedicated thread drives the synchronous LLMEngine; asyncio handlers talk to it.

Handlers submit requests and aborts through a thread-safe inbox; the engine thread drains it between
iterations, steps the engine, and hands each request's outputs to that request's asyncio.Queue (one
`call_soon_threadsafe` per iteration). NOTE: only the engine thread calls the engine; the event loop
only reads immutable things (the tokenizer, max_model_len, the block size).

Admission happens here, per traffic cluster: waiting = queued in the engine + submitted but not yet
handed to it; beyond `maxWaiting` a request gets 429 with a Retry-After estimated from the cluster's
recent admission rate. Every accepted request ends with its output or an explicit error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from stallfree.engine.engine import LLMEngine
from stallfree.engine.outputs import RequestOutput
from stallfree.engine.request import Request
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.server.errors import BadRequest, NotReady, Overloaded
from stallfree.engine.server.observer import EngineObserver
from stallfree.engine.server.traffic import TrafficConfig

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


class EngineThread:
    """The one thread that builds the engine and then runs its loop: jobs run in order, one at a time.

    NOTE: build and step on the same thread. Torch's OpenMP pool belongs to the thread that opens the
    first parallel region, so a model loaded on one thread (asyncio.to_thread's) and stepped on another
    leaves two pools, more OpenMP threads than cores, and then libgomp stops spinning between parallel
    regions: every kernel call sleeps and is woken. On a 2-core box that made a batch-1 decode step
    36 ms instead of 11 ms (docs/engine.md, *The server stepped the engine on a second thread*)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name="stallfree-engine", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the thread after the jobs before it; its result or exception lands in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def close(self, timeout: float) -> None:
        """Let the thread end after its current job; wait at most `timeout` seconds for that."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping for one in-flight request."""

    stream: RequestStream
    req: Request
    scheduled: bool = False
    tokens_seen: int = 0


@dataclass(slots=True)
class RequestStream:
    """What a handler holds: the request's identity and one queue of RequestOutputs for its sequences.

    A request with n > 1 choices runs as n engine requests `children` (`{request_id}-{i}`; just the
    request id when n = 1) sharing the prompt, whose K/V the later ones take from the prefix cache. Their
    outputs arrive interleaved on the one queue; iteration ends when every child has finished."""

    request_id: str
    cluster: str
    prompt_token_ids: list[int]
    arrival_time: float
    children: tuple[str, ...] = ()
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.children:
            self.children = (self.request_id,)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.children)

    def index(self, child_id: str) -> int:
        """The choice index of a child's outputs."""
        return self.children.index(child_id) if len(self.children) > 1 else 0

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out: RequestOutput = await self.queue.get()
            if out.finished:
                self.done.add(out.request_id)
            yield out


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        traffic: TrafficConfig,
        observer: EngineObserver | None = None,
        thread: EngineThread | None = None,
    ):
        """`thread`: the EngineThread that built `engine` (its loop then runs there too); a new one if None."""
        self.engine = engine
        self.traffic = traffic
        self.observer = observer or EngineObserver()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards _pending and _waiting
        self._pending: dict[str, int] = {}  # submitted, not yet in the engine
        self._waiting: dict[str, int] = {}  # in the engine's waiting queue (last snapshot)
        self._running: dict[str, int] = {}
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._last_stats = engine.last_stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread
        self._loop_done: concurrent.futures.Future | None = None
        self._stop = threading.Event()
        self.dead: str | None = None  # why the engine loop died
        self.draining = False
        self.num_in_flight = 0  # accepted, not finished (event loop thread)
        self._idle = asyncio.Event()
        self._idle.set()
        self._apply_config(traffic)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = EngineThread()
        self._loop_done = self._thread.submit(self._run)

    @property
    def running(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done() and self.dead is None

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.close(timeout=30)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and wait until every accepted request has ended. True when idle in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- called from the event loop -----------------------------------------------------------------
    def waiting(self, cluster: str) -> int:
        with self._lock:
            return self._waiting.get(cluster, 0) + self._pending.get(cluster, 0)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(waiting, running) per cluster, including requests not yet handed to the engine."""
        with self._lock:
            waiting = dict(self._waiting)
            for c, n in self._pending.items():
                waiting[c] = waiting.get(c, 0) + n
            return waiting, dict(self._running)

    def check_available(self) -> None:
        if self.dead is not None:
            raise NotReady(f"the engine loop stopped: {self.dead}")
        if self.draining:
            raise NotReady("the server is shutting down and no longer admits requests", retry_after=1)
        if not self.running:
            raise NotReady("the engine is not running yet", retry_after=1)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cluster: str,
        retry_after_hint: float = 1.0,
        n: int = 1,
    ) -> RequestStream:
        """Admit a validated request or raise Overloaded/NotReady. Outputs arrive on the returned stream.

        n > 1 admits n sequences at once or none: they count n against the cluster's maxWaiting. With a
        seed, choice i samples with seed + i (as vLLM), so the choices differ and each is reproducible."""
        try:
            self.check_available()
        except NotReady:
            self.observer.on_rejected(cluster, "draining" if self.draining else "not_ready")
            raise
        spec = self.traffic.cluster(cluster)
        if spec.max_waiting is not None and n > spec.max_waiting:
            raise BadRequest(
                f"n={n} choices would never fit traffic cluster {cluster!r}'s queue (maxWaiting "
                f"{spec.max_waiting}): ask for fewer choices",
                param="n",
            )
        with self._lock:
            waiting = self._waiting.get(cluster, 0) + self._pending.get(cluster, 0)
            if spec.max_waiting is not None and waiting + n > spec.max_waiting:
                full = True
            else:
                full = False
                self._pending[cluster] = self._pending.get(cluster, 0) + n
        if full:
            self.observer.on_rejected(cluster, "queue_full")
            retry = max(1, math.ceil(retry_after_hint))
            raise Overloaded(
                f"traffic cluster {cluster!r} has {waiting} requests waiting (maxWaiting "
                f"{spec.max_waiting}); retry after {retry} s",
                retry_after=retry,
            )
        children = (request_id,) if n == 1 else tuple(f"{request_id}-{i}" for i in range(n))
        stream = RequestStream(request_id, cluster, prompt_token_ids, self.engine.clock(), children)
        child_params = [
            params if params.seed is None or n == 1 else replace(params, seed=params.seed + i)
            for i in range(n)
        ]
        for i in range(n):  # each choice is a request in the counters; the shared prompt counts once
            self.observer.on_arrival(cluster, len(prompt_token_ids) if i == 0 else 0)
        self.num_in_flight += 1
        self._idle.clear()
        self._send("add", (stream, child_params, spec.priority))
        return stream

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort every sequence of the request that has not finished."""
        for child in stream.children:
            if child not in stream.done:
                self._send("abort", child)

    async def update_config(self, config: TrafficConfig) -> None:
        """Apply new tunables from the next iteration; returns once the engine thread has them."""
        self.check_available()
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send("config", (config, done))
        await done

    async def reset_prefix_cache(self) -> int:
        """Drop every cached KV block between two iterations; returns how many were dropped."""
        self.check_available()
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send("reset_prefix_cache", done)
        return await done

    def request_done(self) -> None:
        """A handler finished with a stream (for draining)."""
        self.num_in_flight -= 1
        if self.num_in_flight <= 0:
            self.num_in_flight = 0
            self._idle.set()

    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wakeup.set()

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()  # a dead parallel worker makes /ready not-ready
                    self._wakeup.wait(IDLE_POLL_S)
                    continue
                outs = self.engine.step()
                self._after_step(outs)
        except Exception as e:  # noqa: BLE001 - the loop must never die silently
            logger.exception("the engine loop died; failing %d in-flight requests", len(self._tracked))
            self.dead = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine loop failed: {self.dead}")
            return
        if self._tracked:
            for rid in list(self._tracked):
                self.engine.abort_request(rid)
            self._fail_all("the server stopped before this request finished")
        logger.info("engine loop stopped")

    def _drain_inbox(self) -> None:
        deliveries: list[tuple[RequestStream, RequestOutput]] = []
        acks: list[asyncio.Future | tuple[asyncio.Future, Any]] = []
        processed = 0
        with self._lock:
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                processed += 1
                if kind == "add":
                    stream, child_params, priority = payload
                    self._pending[stream.cluster] -= len(stream.children)
                    for child, params in zip(stream.children, child_params, strict=True):
                        out = self._add(stream, child, params, priority)
                        if out is not None:
                            deliveries.append((stream, out))
                elif kind == "abort":
                    t = self._tracked.get(payload)
                    out = self.engine.abort_request(payload)
                    if t is not None and out is not None:
                        self._observe(t, out)
                        deliveries.append((t.stream, out))
                elif kind == "config":
                    config, fut = payload
                    self._apply_config(config)
                    acks.append(fut)
                elif kind == "reset_prefix_cache":
                    n = self.engine.reset_prefix_cache()
                    logger.info("prefix cache reset: %d blocks dropped", n)
                    acks.append((payload, n))
            if not processed:
                return
            self._snapshot_counts()
            waiting, running = dict(self._waiting), dict(self._running)
        # queues and KV usage changed outside an iteration (adds, aborts): report them now
        self.observer.on_iteration(None, waiting, running, self.engine.block_manager.usage)
        self._deliver(deliveries, acks)

    def _add(
        self, stream: RequestStream, child: str, params: SamplingParams, priority: int
    ) -> RequestOutput | None:
        try:
            req = self.engine.add_request(
                child,
                stream.prompt_token_ids,
                params,
                traffic_cluster=stream.cluster,
                priority=priority,
                arrival_time=stream.arrival_time,
            )
        except ValueError as e:  # validated by the handler already; this is a last line of defence
            self.observer.on_finished(stream.cluster, "error", 0.0)
            return _error_output(stream, child, str(e))
        self._tracked[child] = _Tracked(stream, req)
        return None

    def _apply_config(self, config: TrafficConfig) -> None:
        self.engine.set_tunables(config.tunables())
        sched = self.engine.scheduler
        if sched.config.chunk_align != config.chunk_align:
            sched.config = replace(sched.config, chunk_align=config.chunk_align)
        self.traffic = config
        self.observer.on_config(config)

    def _snapshot_counts(self) -> None:
        sched = self.engine.scheduler
        self._waiting = sched.count_by_cluster(sched.waiting)
        self._running = sched.count_by_cluster(sched.running)

    def _after_step(self, outs: list[RequestOutput]) -> None:
        deliveries = []
        for out in outs:
            t = self._tracked.get(out.request_id)
            if t is not None:
                self._observe(t, out)
                deliveries.append((t.stream, out))
        for t in self._tracked.values():  # prefill chunks that produced no token yet
            if not t.scheduled and t.req.first_scheduled_time is not None:
                t.scheduled = True
                self.observer.on_scheduled(t.stream.cluster, t.req.first_scheduled_time - t.req.arrival_time)
        with self._lock:
            self._snapshot_counts()
            waiting, running = dict(self._waiting), dict(self._running)
        stats = self.engine.last_stats
        if stats is self._last_stats:  # an empty step reports no new iteration
            stats = None
        self._last_stats = self.engine.last_stats
        self.observer.on_iteration(stats, waiting, running, self.engine.block_manager.usage)
        self._deliver(deliveries, [])

    def _observe(self, t: _Tracked, out: RequestOutput) -> None:
        req, cluster = t.req, t.stream.cluster
        if not t.scheduled and req.first_scheduled_time is not None:
            t.scheduled = True
            self.observer.on_scheduled(cluster, req.first_scheduled_time - req.arrival_time)
        times = req.token_times
        n = len(times)
        if n > t.tokens_seen:
            if t.tokens_seen == 0:
                self.observer.on_first_token(cluster, times[0] - req.arrival_time)
            start = max(t.tokens_seen - 1, 0)
            gaps = [b - a for a, b in zip(times[start : n - 1], times[start + 1 : n], strict=True)]
            if gaps:
                self.observer.on_token_gaps(cluster, gaps)
            self.observer.on_generation_tokens(cluster, n - t.tokens_seen)
            t.tokens_seen = n
        if out.finished:
            end = req.finish_time if req.finish_time is not None else self.engine.clock()
            outcome = out.finish_reason or "error"
            self.observer.on_finished(cluster, outcome, end - req.arrival_time)
            if out.metrics is not None:
                self.observer.on_request_done(
                    cluster, outcome, out.metrics, req.prompt_len, req.sampling_params.max_tokens
                )
            del self._tracked[out.request_id]

    def _deliver(self, deliveries: list[tuple[RequestStream, RequestOutput]], acks: list) -> None:
        if not deliveries and not acks:
            return
        assert self._loop is not None  # noqa: S101 - set by start() before the thread runs

        def deliver() -> None:
            for stream, out in deliveries:
                stream.queue.put_nowait(out)
            for ack in acks:  # a future, or (future, its result)
                fut, result = ack if isinstance(ack, tuple) else (ack, None)
                if not fut.done():
                    fut.set_result(result)

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d outputs", len(deliveries))

    def _fail_all(self, message: str) -> None:
        deliveries = []
        for t in list(self._tracked.values()):
            self.observer.on_finished(t.stream.cluster, "error", self.engine.clock() - t.req.arrival_time)
            deliveries.append((t.stream, _error_output(t.stream, t.req.request_id, message)))
        self._tracked.clear()
        acks = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                stream = payload[0]
                deliveries += [(stream, _error_output(stream, c, message)) for c in stream.children]
            elif kind == "config":
                acks.append(payload[1])
            elif kind == "reset_prefix_cache":
                acks.append((payload, 0))
        self._deliver(deliveries, acks)


def _error_output(stream: RequestStream, child: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=child,
        prompt_token_ids=stream.prompt_token_ids,
        token_ids=[],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        traffic_cluster=stream.cluster,
        error=message,
    )
