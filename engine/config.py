"""Engine configuration: one frozen object per component, built once at the edge and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.engine.attention.registry import check_name as check_attention_backend

POLICIES = ("sarathi", "vllm", "orca", "static")
# `auto` for the dtype and the quantization is resolved once, by stallfree.engine.placement.
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("none", "int8", "int4")  # CPU weight-only (stallfree.engine.model.cpu_linear)


@dataclass(frozen=True, slots=True)
class TrafficClusterLimits:
    """What the scheduler needs to know about one traffic cluster (the rest lives in the server)."""

    name: str = "default"
    chunk_cap: int | None = None  # prefill tokens per iteration for this cluster; None = only the budget
    max_running: int | None = None
    priority: int = 0
    # The cluster's SLOs, for time-budgeted iterations (SchedulerTunables.time_target): an iteration in which
    # one of its requests decodes takes at most time_target x tbt_slo; one while it waits for a first token,
    # at most ttft_share x ttft_slo. None: the scheduler's default TBT target, and no TTFT bound.
    tbt_slo: float | None = None
    ttft_slo: float | None = None

    def __post_init__(self) -> None:
        if self.chunk_cap is not None and self.chunk_cap < 1:
            raise ValueError(f"traffic cluster {self.name!r}: chunk cap must be >= 1, got {self.chunk_cap}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(
                f"traffic cluster {self.name!r}: max running must be >= 1, got {self.max_running}"
            )
        for what, v in (("TBT SLO", self.tbt_slo), ("TTFT SLO", self.ttft_slo)):
            if v is not None and not v > 0:
                raise ValueError(f"traffic cluster {self.name!r}: {what} must be > 0 seconds, got {v}")


@dataclass(frozen=True, slots=True)
class SchedulerTunables:
    """What may change between iterations (admin API, budget controller).

    Two ways to budget an iteration (sarathi):
      tokens  time_target None: every iteration holds at most token_budget tokens (the paper's budget).
      time    time_target set: each iteration's prefill gets the largest chunk set whose predicted time
              (the engine's calibrated cost model) fits time_target x the strictest P99 TBT SLO among the
              clusters with a request decoding in it, and ttft_share x the strictest TTFT SLO among the
              clusters with a request waiting for its first token. token_budget is then the cap (the
              ceiling an iteration with nothing to protect grows to) and min_token_budget the floor (what
              an iteration holds even when the prediction says less, so prefill always progresses).
    """

    token_budget: int = 512
    clusters: tuple[TrafficClusterLimits, ...] = ()
    time_target: float | None = None
    min_token_budget: int = 16
    ttft_share: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ValueError(f"token_budget must be a positive integer, got {self.token_budget!r}")
        if self.time_target is not None and not 0 < self.time_target <= 1:
            raise ValueError(
                f"time_target must be in (0, 1] (a share of the TBT SLO), got {self.time_target!r}"
            )
        if not isinstance(self.min_token_budget, int) or self.min_token_budget < 1:
            raise ValueError(f"min_token_budget must be a positive integer, got {self.min_token_budget!r}")
        if not 0 < self.ttft_share <= 1:
            raise ValueError(f"ttft_share must be in (0, 1], got {self.ttft_share!r}")
        names = [c.name for c in self.clusters]
        if len(names) != len(set(names)):
            raise ValueError(f"traffic cluster names must be unique, got {names}")

    def cluster(self, name: str) -> TrafficClusterLimits | None:
        for c in self.clusters:
            if c.name == name:
                return c
        return None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "sarathi"
    max_num_seqs: int = 128
    max_model_len: int = 2048
    # Round prefill chunks down to a multiple of this (a GPU tile, e.g. 32); 0 = no alignment.
    chunk_align: int = 0
    # sarathi only: put decodes in the same batch as prefill chunks (False = the paper's "chunking only"
    # ablation: prefill chunks and decodes take turns).
    hybrid_batching: bool = True
    # sarathi only: a prefill chunk's charge against the token budget grows with the context it attends
    # over. With C set, a chunk of n tokens after s computed ones costs n * (1 + (s + (n - 1) / 2) / C)
    # budget tokens, so chunks deep in a long prompt are shorter and an iteration takes about what the
    # budget buys at the start of a prompt. C is the context at which a token's attention costs as much as
    # the rest of its forward pass (`stallfree tune` measures it). None: the paper's plain token count.
    chunk_context_scale: int | None = None
    # Time-budgeted iterations: the P99 TBT target of a cluster that states none (seconds). 0.25 s keeps a
    # stream's worst gaps under the ~0.2-0.3 s at which a reader notices a pause (people read ~4-5 tokens
    # per second), on any hardware: a faster machine gets bigger chunks, not a faster target.
    default_tbt_slo: float = 0.25
    tunables: SchedulerTunables = field(default_factory=SchedulerTunables)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.chunk_align < 0:
            raise ValueError(f"chunk_align must be >= 0, got {self.chunk_align}")
        if not self.default_tbt_slo > 0:
            raise ValueError(f"default_tbt_slo must be > 0 seconds, got {self.default_tbt_slo!r}")
        if self.chunk_context_scale is not None and (
            not isinstance(self.chunk_context_scale, int) or self.chunk_context_scale < 1
        ):
            raise ValueError(
                f"chunk_context_scale must be a positive integer, got {self.chunk_context_scale!r}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Size the KV cache from a memory budget, or give the block count directly.
    kv_cache_memory_gb: float | None = None
    num_kv_blocks: int | None = None
    # Reuse the K/V of full blocks of identical prefixes across requests (vLLM's automatic prefix caching).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor x pipeline parallelism: T * P worker processes, one device (or CPU rank) each."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # A worker that sends nothing for this long while a micro-batch is in flight counts as dead.
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # path to a .gguf or a Hugging Face folder; None = bundled default
    # "auto": read the weights at `model`; "dummy": random weights of the shape `model` names (a shape in
    # stallfree.engine.model.dummy.SHAPES, or an HF config.json), built on the device (benchmarks).
    load_format: str = "auto"
    # auto: resolved once by stallfree.engine.placement (one CPU: bfloat16; CPU worker ranks: float32;
    # CUDA: bfloat16; a loaded model: its own)
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    attention_backend: str = "auto"  # auto or a name of stallfree.engine.attention.registry's BACKENDS
    cuda_graphs: bool = True  # CUDA: replay decode iterations from graphs captured at start-up
    # CUDA: hybrid/prefill iterations up to this many tokens replay piecewise graphs (0 = always eager)
    max_graph_tokens: int = 1024
    max_model_len: int | None = None  # None = the model's context length
    # CPU, bf16 only: int8 / int4 weight-only linear layers; auto: int4 with bf16 on one CPU (placement)
    quantization: str = "auto"
    threads: int | None = None  # torch CPU threads; None = leave torch's setting (OMP_NUM_THREADS or cores)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # cost_model.json from `stallfree profile`: the prior of the engine's calibrated iteration cost model
    # (None: the conservative built-in one); time-budgeted iterations are sized with it
    cost_model: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_attention_backend(self.attention_backend)
        if self.quantization not in ("auto", *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of auto, {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization not in ("auto", "none") and self.parallel.world_size > 1:
            raise ValueError("quantization runs in the single-process CPU engine only (world size 1)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
