"""Offline inference in the shape vLLM users know: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from stallfree.engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulerTunables,
    TrafficClusterLimits,
)
from stallfree.engine.engine import create_engine
from stallfree.engine.outputs import RequestOutput
from stallfree.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


class LLM:
    """An engine plus a loop that runs prompts to completion.

    model=None serves the bundled SmolLM2-135M-Instruct; otherwise a .gguf file or a Hugging Face folder.
    load_format="dummy" builds random weights (seeded by `seed`) instead of reading any: `model` then names
    the shape, a name in stallfree.engine.model.dummy.SHAPES (None = smollm2-135m) or an HF config.json
    (or a folder holding one), as vLLM's dummy format takes the model for its config. For benchmarks.
    policy: sarathi (stall-free batching), vllm, orca or static. token_budget caps the tokens of one
    iteration (sarathi); chunk_align rounds prefill chunks to a tile; chunk_context_scale charges a chunk for
    the context it attends over (SchedulerConfig). tensor_parallel_size and
    pipeline_parallel_size > 1 run the model in T x P worker processes (see docs/parallelism.md).
    attention_backend: auto (CUDA: the Triton kernels in bf16/fp16, torch in fp32; CPU: the C++ kernels of
    stallfree.engine.kernels.cpu_fused, or torch where they cannot be built), torch (the plain-torch
    reference), cpu, triton or flashinfer. enforce_eager=True runs CUDA decode iterations without CUDA graphs (as vLLM's).
    enable_prefix_caching (default True) reuses the K/V of full blocks shared with earlier prompts.
    device, dtype and quantization "auto" resolve as `stallfree serve` resolves them
    (stallfree.engine.placement), so both give the same answer for the same model and prompt: the device is
    cuda when available, else cpu; on CUDA bfloat16; in one CPU process bfloat16 with int4 weights, on CPU
    worker ranks float32; with loaded_model, its own dtype. dtype="float32" is the exact reference. On the
    CPU, bfloat16 runs every linear layer through one row-invariant C++ GEMM, with bf16 (quantization="none")
    or int4/int8 weight-only quantized weights (docs/engine.md measures each against fp32); threads sets
    torch's CPU threads.
    """

    def __init__(
        self,
        model: str | None = None,
        policy: str = "sarathi",
        token_budget: int = 512,
        max_num_seqs: int = 128,
        block_size: int = 16,
        dtype: str = "auto",
        *,
        load_format: str = "auto",
        max_model_len: int | None = None,
        chunk_align: int = 0,
        chunk_context_scale: int | None = None,
        hybrid_batching: bool = True,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        device: str = "auto",
        seed: int = 0,
        traffic_clusters: Sequence[TrafficClusterLimits] = (),
        loaded_model: Any = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        quantization: str = "auto",
        threads: int | None = None,
    ) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(
                f"token_budget must be a positive integer (tokens per iteration), got {token_budget!r}"
            )
        config = EngineConfig(
            model=model,
            load_format=load_format,
            dtype=dtype,
            quantization=quantization,
            threads=threads,
            device=device,
            attention_backend=attention_backend,
            cuda_graphs=not enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
            scheduler=SchedulerConfig(
                policy=policy,
                max_num_seqs=max_num_seqs,
                chunk_align=chunk_align,
                chunk_context_scale=chunk_context_scale,
                hybrid_batching=hybrid_batching,
                tunables=SchedulerTunables(token_budget=token_budget, clusters=tuple(traffic_clusters)),
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
                enable_prefix_caching=enable_prefix_caching,
            ),
        )
        self.engine = create_engine(config, loaded=loaded_model)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (a string or a list of token ids) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_for(len(prompts), sampling_params)
        # Validate everything before queueing anything, so a bad prompt leaves no half-run batch.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for ids, sp in zip(token_ids, params, strict=True):
            self.engine.validate_prompt(ids, sp)
        return self._run(token_ids, params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message")
        convs: list[Messages] = [messages] if isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item]
        tok = self.engine.tokenizer
        token_ids = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(token_ids, sampling_params, use_tqdm)

    @staticmethod
    def _params_for(n: int, sp: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts: give one, or one per prompt")
        return sp

    def _run(
        self, token_ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool | None
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"gen-{next(self._ids)}" for _ in token_ids]
        for rid, t, sp in zip(ids, token_ids, params, strict=True):
            engine.add_request(rid, t, sp)
        done: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not show) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in ids]
