"""Runs one iteration: flattens the batch, runs the model over the paged KV cache, samples.

The batch is one ragged tensor of T tokens (decodes first, then prefill chunks) with absolute positions.
Logits are computed only for requests that sample this step: a decode, or a prefill whose last chunk just
ran. Intermediate prefill chunks only fill the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stallfree.engine.attention import KVCache, build_metadata, make_attention
from stallfree.engine.sampler import Sampler, SampleRequest, SampleResult
from stallfree.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    samples: dict[str, SampleResult]  # request id -> sampled token, for requests that sampled
    time_prepare: float  # seconds building tensors and attention metadata
    time_forward: float  # seconds in the model: layers, attention and the logits of sampled rows
    time_sample: float  # seconds choosing tokens from the logits


class ModelRunner:
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
        seed: int = 0,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device)
        self.attention = make_attention(attention_backend, self.cache, num_heads, num_kv_heads, head_dim)
        # torch: plain torch ops, the reference path; cpu: the C++ kernels for the layers' elementwise work
        # and for decodes read from the pages in place (build_metadata then describes them by block table)
        model.kernels = getattr(self.attention, "kernels", None)  # type: ignore[assignment]
        self.paged_decodes = model.kernels is not None
        self.sampler = Sampler(stop_token_ids, seed=seed, device=device)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        input_ids, positions = flatten_batch(out, self.device)
        meta = build_metadata(out, self.block_size, self.device, self.paged_decodes)
        attend = self.attention.bind(meta)
        sample_rows, sample_reqs = [], []
        offset = 0
        for c in out.chunks:
            offset += c.num_tokens
            if c.sample:
                sample_rows.append(offset - 1)  # the chunk's last token predicts the next one
                sample_reqs.append(SampleRequest.of(c, out.allowed_tokens.get(c.request_id)))
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, attend)  # (T, hidden)
        logits = None
        if sample_rows:
            rows = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[rows])  # (N, vocab) float32
        self._sync()
        t2 = time.perf_counter()
        samples: dict[str, SampleResult] = {}
        if logits is not None:
            for req, res in zip(sample_reqs, self.sampler.sample(logits, sample_reqs), strict=True):
                samples[req.request_id] = res
        t3 = time.perf_counter()
        return RunnerOutput(samples, t1 - t0, t2 - t1, t3 - t2)


def flatten_batch(out: SchedulerOutput, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's token ids and their absolute positions, both (T,) int64, decodes first."""
    ids = np.fromiter((t for c in out.chunks for t in c.token_ids), dtype=np.int64, count=out.num_tokens)
    # NOTE: positions are absolute (chunk start + offset), never restarted per chunk: RoPE depends on them.
    pos = np.concatenate([np.arange(c.start, c.start + c.num_tokens, dtype=np.int64) for c in out.chunks])
    return torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device)
