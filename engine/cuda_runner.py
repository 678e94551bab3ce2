"""The CUDA model runner: fused kernels, decode iterations replayed from CUDA graphs, one sync per iteration.

On a GPU a step of a 7-8B model costs a few milliseconds, so launches and host synchronisations, not
FLOPs, decide decode speed. This runner
- lays the batch out on the host from the scheduler's integers and copies it to the GPU in one transfer
  (stallfree.engine.cuda_batch), never reading anything back to plan;
- runs the model with its fused kernels (add+RMSNorm, RoPE, SiLU-and-mul: stallfree.engine.kernels.fused)
  and paged attention (stallfree.engine.cuda_attention);
- replays decode-only iterations from CUDA graphs captured at start-up for padded batch sizes 1, 2, 4, 8,
  16, 24, 32, 48, 64, ... up to max_num_seqs: padding rows write no K/V (slot -1) and attend to nothing;
- replays hybrid and prefill iterations of up to `max_graph_tokens` tokens piecewise: the layers between
  two attentions from graphs captured per padded token count, attention eagerly in between
  (stallfree.engine.cuda_graphs; docs/gpu.md has the measurement that asked for it); larger ones run
  eagerly, where the GPU work outlasts the host's launches;
- samples on the GPU and reads the sampled tokens back in one copy: the iteration's one synchronisation.

The CPU path (and the torch attention backend on CUDA, the reference) keeps `ModelRunner`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from stallfree.engine.attention import KVCache
from stallfree.engine.cuda_attention import DeviceBatch, make_cuda_attention
from stallfree.engine.cuda_batch import HostBatch, Stager, host_batch
from stallfree.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs, graph_batch_sizes, piecewise_sizes
from stallfree.engine.gpu_sampler import GpuSampler
from stallfree.engine.kernels import fused
from stallfree.engine.model_runner import RunnerOutput
from stallfree.engine.sampler import SampleRequest, SampleResult
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class CudaModelRunner:
    """Runs one iteration on a CUDA device with the Triton or FlashInfer attention backend."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        stop_token_ids: frozenset[int],
        max_num_seqs: int,
        max_model_len: int,
        seed: int = 0,
        cuda_graphs: bool = True,
        max_graph_tokens: int = 1024,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device)
        self.attention = make_cuda_attention(attention_backend, self.cache, num_heads, num_kv_heads, head_dim)
        self.sampler = GpuSampler(stop_token_ids, seed=seed, device=device)
        self.stager = Stager(device)
        self.max_pages = -(-max_model_len // block_size)
        model.kernels = fused  # type: ignore[assignment]
        use_graphs = cuda_graphs and attention_backend == "triton" and device.type == "cuda"
        self.graphs = (
            DecodeGraphs(self, graph_batch_sizes(max_num_seqs), self.max_pages) if use_graphs else None
        )
        pieces = piecewise_sizes(max_graph_tokens)
        self.piecewise = PiecewiseGraphs(self, pieces) if use_graphs and pieces else None

    def warm_up(self) -> float:
        """Compile every kernel and capture the decode graphs before the engine reports ready; seconds taken."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._warm_eager()
            pool = torch.cuda.graph_pool_handle() if self.graphs is not None else None
            if self.graphs is not None:
                self.graphs.capture(pool)
            if self.piecewise is not None:
                self.piecewise.capture(pool)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _warm_eager(self) -> None:
        """One hybrid iteration (a decode, a first chunk, a later chunk) to compile the eager kernels.

        NOTE: it writes K/V into blocks 0-3; harmless, since a block's slots are always written before any
        request attends to them.
        """
        bs = self.block_size
        if self.cache.k[0].shape[0] < 4:
            return
        n, ctx = 2 * bs, bs + 3  # the later chunk starts mid-page
        i64 = np.int64
        table = np.arange(4, dtype=i64)
        pos = np.concatenate([[bs], np.arange(n), np.arange(ctx, ctx + n)]).astype(i64)
        hb = HostBatch(
            input_ids=np.zeros(1 + 2 * n, dtype=i64),
            positions=pos,
            slot_mapping=pos.copy(),  # blocks 0..3 in order: slot = position
            num_decodes=1,
            decode_lens=np.array([bs + 1], dtype=i64),
            decode_tables=table[None, :],
            prefill_q_starts=np.array([1, 1 + n], dtype=i64),
            prefill_q_lens=np.array([n, n], dtype=i64),
            prefill_ctx_lens=np.array([0, ctx], dtype=i64),
            prefill_tables=np.stack([table, table]),
            prefill_hist_slots=np.concatenate([np.arange(n), np.arange(ctx + n)]).astype(i64),
            prefill_hist_offsets=np.array([0, n, 2 * n + ctx], dtype=i64),
            sample_rows=np.array([0, n, 2 * n], dtype=i64),
        )
        _, logits = self._eager(hb)
        assert logits is not None
        reqs = [SampleRequest(f"warm-up-{i}", SamplingParams(max_tokens=1), 0) for i in range(3)]
        self.sampler.sample(logits, reqs)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _padded(self, batch: int) -> int:
        if self.graphs is not None:
            size = self.graphs.padded(batch)
            if size is not None:
                return size
        return batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        hb = host_batch(out, self.block_size)
        reqs = [SampleRequest.of(c, out.allowed_tokens.get(c.request_id)) for c in out.chunks if c.sample]
        if self.graphs is not None and hb.decode_only and self.graphs.padded(hb.num_decodes) is not None:
            t1 = time.perf_counter()
            logits = self.graphs.run(hb)  # (D, V): every decode samples
        else:
            t1, logits = self._eager(hb)
        samples: dict[str, SampleResult] = {}
        if logits is not None:
            for req, res in zip(reqs, self.sampler.sample(logits, reqs), strict=True):
                samples[req.request_id] = res
        else:
            self._sync()  # keeps timings and buffers honest
        t2 = time.perf_counter()
        # NOTE: the forward and the sampling kernels finish together at the one copy back; their sum is
        # reported as forward time, and sampling time is the host's share after it.
        return RunnerOutput(samples, t1 - t0, t2 - t1, 0.0)

    def _eager(self, hb: HostBatch) -> tuple[float, torch.Tensor | None]:
        D = hb.num_decodes
        ids, pos, slots, dlens, dtables, qs, ql, ctx, ptables, hist, rows = self.stager.stage(
            [
                hb.input_ids, hb.positions, hb.slot_mapping, hb.decode_lens, hb.decode_tables,
                hb.prefill_q_starts, hb.prefill_q_lens, hb.prefill_ctx_lens, hb.prefill_tables,
                hb.prefill_hist_slots, hb.sample_rows,
            ]
        )  # fmt: skip
        # NOTE: split-KV counts depend on the padded batch size only, so graphs and eager agree.
        splits = self.attention.splits(self._padded(D)) if D else 1
        batch = DeviceBatch(hb, slots, dlens, dtables, splits, qs, ql, ctx, ptables, hist)
        t1 = time.perf_counter()
        if self.piecewise is not None and self.piecewise.padded(hb.num_tokens) is not None:
            hidden = self.piecewise.run(hb, ids, pos, slots, self.attention.bind(batch, store=False))
        else:
            hidden = self.model(ids, pos, self.attention.bind(batch))  # (T, C)
        if not len(hb.sample_rows):
            return t1, None
        return t1, self.model.compute_logits(hidden.index_select(0, rows))  # (N, V) float32
