"""The model runner: one iteration for every attention backend, on one device or as one pipeline stage.

Per iteration it
- lays the batch out on the host from the scheduler's integers (stallfree.engine.attention.batch: T tokens,
  decodes first, then prefill chunks, with absolute positions) and copies it to the device in one
  transfer, never reading anything back to plan;
- has the backend build its metadata from that one batch and bind its per-layer attention;
- runs the model with the backend's fused kernels (or plain torch ops), eagerly or, where the backend
  supports graphs on a CUDA device, from CUDA graphs: decode-only iterations replay a graph of the whole
  forward padded to a captured batch size, hybrid iterations up to `max_graph_tokens` tokens replay the
  layers between attentions piecewise (stallfree.engine.cuda_graphs);
- computes logits only for the rows that sample (a decode, or a prefill whose last chunk just ran;
  intermediate chunks only fill the cache) and samples them, on the device in one batch when the backend
  says so (one synchronisation per iteration), else row by row.

The parallel workers run the same loop over their stage of the model (the model class itself, cut to its
layers by LlamaForCausalLM.keep_layers), with a `StageLink` that receives the previous stage's hidden states
and sends theirs on; their graphs cover the stage (the hand-offs run between replays).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.batch import DeviceBatch, HostBatch, Stager, host_batch
from stallfree.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs, graph_batch_sizes, piecewise_sizes
from stallfree.engine.gpu_sampler import GpuSampler
from stallfree.engine.sampler import Sampler, SampleRequest, SampleResult
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    samples: dict[str, SampleResult]  # request id -> sampled token, for requests that sampled
    time_prepare: float  # seconds building tensors and attention metadata
    time_forward: float  # seconds in the model: layers, attention and the logits of sampled rows
    time_sample: float  # seconds choosing tokens from the logits


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """CUDA graphs for a backend that supports them, on a CUDA device."""

    max_num_seqs: int  # the largest decode batch captured
    max_model_len: int  # sizes the captured block tables
    max_graph_tokens: int = 1024  # hybrid iterations up to this many tokens run piecewise (0 = eager)


class StageLink(Protocol):
    """How a pipeline stage gets its input and hands on its output (the parallel workers)."""

    last: bool  # the last stage computes logits; the others send their hidden states on

    def receive(self, num_tokens: int) -> Tensor | None:
        """(T, C) hidden states from the previous stage, or None on the first stage (it embeds ids)."""
        ...

    def send(self, hidden: Tensor) -> None: ...


class ModelRunner:
    """Runs iterations of `model` with one attention backend (which holds the KV cache)."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        *,
        stop_token_ids: frozenset[int],
        seed: int = 0,
        graphs: GraphConfig | None = None,
        link: StageLink | None = None,
        samples: bool = True,
    ) -> None:
        """graphs: capture CUDA graphs (ignored unless the backend supports them on a CUDA device).
        link: run as a pipeline stage. samples=False: compute logits (a tensor-parallel collective) but
        leave the sampling to another rank."""
        self.model, self.backend = model, backend
        self.cache = backend.cache
        self.device = backend.cache.device
        self.block_size = backend.cache.block_size
        self.link = link
        sampler_cls = GpuSampler if backend.samples_on_device else Sampler
        self.sampler = sampler_cls(stop_token_ids, seed=seed, device=self.device) if samples else None
        self.stager = Stager(self.device)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if graphs is not None and backend.supports_graphs and self.device.type == "cuda":
            max_pages = -(-graphs.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(model, backend, graph_batch_sizes(graphs.max_num_seqs), max_pages)
            pieces = piecewise_sizes(graphs.max_graph_tokens)
            self.piecewise = PiecewiseGraphs(model, backend, pieces) if pieces else None

    def release(self, request_id: str) -> None:
        if self.sampler is not None:
            self.sampler.release(request_id)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        hb = host_batch(out, self.block_size)
        reqs = [SampleRequest.of(c, out.allowed_tokens.get(c.request_id)) for c in out.chunks if c.sample]
        if self.graphs is not None and self.graphs.fits(hb):
            t1 = time.perf_counter()
            received = self.link.receive(hb.num_tokens) if self.link is not None else None
            out = self.graphs.run(hb, received)  # (D, V): every decode samples; (D, C) before the last stage
            logits = self._hand_on(out, persistent=True)
        else:
            t1, logits = self._eager(hb)
        on_device = self.backend.samples_on_device
        if logits is None or not on_device:
            self._sync()  # keeps timings and buffers honest
        t2 = time.perf_counter()
        samples: dict[str, SampleResult] = {}
        if logits is not None and self.sampler is not None:
            for req, res in zip(reqs, self.sampler.sample(logits, reqs), strict=True):
                samples[req.request_id] = res
        t3 = time.perf_counter()
        if on_device:
            # NOTE: the forward and the sampling kernels finish together at the one copy back; their sum is
            # reported as forward time.
            return RunnerOutput(samples, t1 - t0, t3 - t1, 0.0)
        return RunnerOutput(samples, t1 - t0, t2 - t1, t3 - t2)

    def _padded(self, decodes: int) -> int:
        size = self.graphs.padded(decodes) if self.graphs is not None else None
        return decodes if size is None else size

    def _eager(self, hb: HostBatch) -> tuple[float, Tensor | None]:
        """Forward without a whole-iteration graph; returns (when preparing ended, logits of sampled rows)."""
        batch: DeviceBatch = self.stager.stage_batch(hb)
        meta = self.backend.build_metadata(batch, self._padded(hb.num_decodes))
        x = batch.input_ids
        if self.link is not None:
            received = self.link.receive(hb.num_tokens)
            x = x if received is None else received
        t1 = time.perf_counter()
        kernels = self.backend.kernels
        piecewise = self.piecewise is not None and self.piecewise.padded(hb.num_tokens) is not None
        if piecewise:
            attend = self.backend.bind(meta, store=False)
            hidden = self.piecewise.run(hb, x, batch.positions, batch.slot_mapping, attend)
        else:
            attend, rows = self.backend.bind(meta), self.backend.paged_rows(meta)
            hidden = self.model(x, batch.positions, attend, kernels, rows)  # (T, C)
        if self._hand_on(hidden, persistent=piecewise) is None:
            return t1, None
        if not len(hb.sample_rows):
            return t1, None
        return t1, self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # (N, V) float32

    def _hand_on(self, out: Tensor, persistent: bool) -> Tensor | None:
        """On a pipeline stage before the last: send `out` (hidden states) to the next stage and return None.
        Otherwise return `out`. persistent: `out` is a graph's output buffer, which the next replay rewrites
        while the send may still be reading it, so a copy is sent."""
        if self.link is None or self.link.last:
            return out
        self._sync()
        self.link.send(out.clone() if persistent else out)
        return None

    def warm_up(self) -> float:
        """Compile the backend's kernels and capture the graphs before the engine reports ready; seconds."""
        t0 = time.perf_counter()
        if not self.backend.compiles_kernels and self.graphs is None:
            return 0.0
        with torch.inference_mode():
            self._warm_eager()
            pool = torch.cuda.graph_pool_handle() if self.graphs is not None else None
            if self.graphs is not None:
                self.graphs.capture(pool)
            if self.piecewise is not None:
                self.piecewise.capture(pool)
        self._sync()
        return time.perf_counter() - t0

    def _warm_eager(self) -> None:
        """One hybrid iteration (a decode, a first chunk, a later chunk starting mid-page), sampled.

        NOTE: it writes K/V into the first blocks; harmless, since a block's slots are always written before any
        request attends to them.
        """
        bs = self.block_size
        n, ctx = 2 * bs, bs + 3
        table = tuple(range(-(-(ctx + n) // bs)))  # blocks 0-3 from block size 3 up
        if self.cache.num_blocks < len(table):
            return

        def chunk(i: int, start: int, num: int) -> ScheduledChunk:
            return ScheduledChunk(
                f"warm-up-{i}",
                (0,) * num,
                start,
                table,
                num == 1,
                True,
                "warm-up",
                SamplingParams(max_tokens=1),
                0,
            )

        chunks = (chunk(0, bs, 1), chunk(1, 0, n), chunk(2, ctx, n))
        hb = host_batch(SchedulerOutput(chunks, (), 1 + 2 * n, 2 * n, 1), bs)
        _, logits = self._eager(hb)
        if logits is not None and self.sampler is not None:
            self.sampler.sample(logits, [SampleRequest.of(c) for c in chunks])
