"""`stallfree serve`: the OpenAI-compatible server with stall-free batching.

Starts listening at once (/health answers) and loads the model in the background; /ready turns 200 when
the engine loop runs. SIGTERM/SIGINT: stop admitting, let in-flight requests finish (--drain-timeout),
exit. Heavy imports (torch, fastapi) happen after argument parsing, so --help is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from stallfree.engine.attention.registry import BACKENDS
from stallfree.engine.config import DTYPES, LOAD_FORMATS, POLICIES, QUANTIZATIONS
from stallfree.engine.server.tool_calls.parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

EPILOG = """\
environment:
  STALLFREE_API_KEY       API key for /v1/* (same as --api-key)
  STALLFREE_ADMIN_TOKEN   bearer token for /admin/v1/* (same as --admin-token); without one the admin API
                          is open when bound to 127.0.0.1 and disabled (403) otherwise

budgets:
  By default every iteration is budgeted in time (--time-target 0.8): its prefill chunks are the largest set
  whose predicted time fits 0.8 x the strictest P99 TBT SLO among the clusters decoding in it (a cluster
  without one: --default-tbt-slo, 0.25 s), growing up to the cap (2048 tokens) when nobody decodes. The
  prediction is the engine's cost model, refitted from its own iteration times (--cost-model: a profile as
  the starting point). --token-budget N alone pins the paper's fixed token budget instead.

traffic clusters file (YAML or JSON):
  tokenBudget: 2048      # with timeTarget: the cap; without: the fixed budget
  timeTarget: 0.8        # null: a fixed token budget
  trafficClusters:
    - name: chat
      match: {header: chat, maxPromptTokens: 2048}     # x-traffic-cluster header / prompt length range
      slo: {ttftP99Seconds: 2.0, tbtP99Seconds: 0.2}
      chunkCap: 256
      maxWaiting: 64                                  # beyond it: 429 + Retry-After
      maxRunning: 32
      priority: 0

examples:
  stallfree serve                                     # bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
  stallfree serve --model ./Llama-3.2-1B --host 0.0.0.0 --traffic-clusters engine.yaml
  stallfree serve --token-budget 256                  # the paper's fixed budget instead of a time budget
  stallfree serve --load-format dummy --shape llama3-8b --device cuda   # random weights, 8B shape (GPU)
"""


DEFAULT_TOKEN_BUDGET = 512  # the fixed budget of a pinned or baseline policy
DEFAULT_TIME_TARGET = 0.8  # share of the P99 TBT SLO an iteration may take: the rest absorbs prediction error
DEFAULT_TIME_CAP = 2048  # tokens of a time-budgeted iteration that has no decode to protect

# stallfree.engine.model.dummy.SHAPES, without importing torch (for --help)
SHAPE_NAMES = ("smollm2-135m", "llama3-8b", "mistral-7b", "qwen3-8b", "tiny-hd128")


def add_load_format_args(group) -> None:
    """--load-format and --shape, the same on every command that loads a model (serve, profile, bench)."""
    group.add_argument("--load-format", choices=LOAD_FORMATS, default=None, help="auto: read the weights "
                       "at --model; dummy: random weights (seeded by --seed) of the shape --model names, built "
                       "on the device, for benchmarks without weights (default: auto; dummy with --shape)")  # fmt: skip
    group.add_argument("--shape", metavar="NAME|CONFIG", default=None, help="shorthand for --load-format "
                       f"dummy --model NAME|CONFIG: a named shape ({', '.join(SHAPE_NAMES)}) or an HF "
                       "config.json (or a folder holding one); default with dummy: smollm2-135m")  # fmt: skip


def resolve_load_format(
    model: str | None, load_format: str | None, shape: str | None
) -> tuple[str | None, str]:
    """(model, load_format) from --model, --load-format and --shape. --shape implies dummy.

    Raises ValueError when they contradict each other or a dummy shape is neither a known name nor a config.
    """
    if shape is not None:
        if load_format == "auto":
            raise ValueError(
                "--shape builds random weights: it needs --load-format dummy (or no --load-format)"
            )
        if model is not None:
            raise ValueError("--shape and --model both name the model: with --load-format dummy give one")
        model, load_format = shape, "dummy"
    load_format = load_format or "auto"
    if load_format == "dummy":
        from stallfree.engine.model.dummy import dummy_config  # noqa: PLC0415 - imports torch

        dummy_config(model or SHAPE_NAMES[0])  # a bad name or config fails here, naming the shapes
    return model, load_format


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stallfree serve",
        description="OpenAI-compatible LLM server with chunked prefill and stall-free batching.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="a .gguf file, a Hugging Face folder or hf://ORG/NAME[@REV] "
                   "(downloaded once, see `stallfree download`); default: the bundled SmolLM2-135M-Instruct")  # fmt: skip
    m.add_argument("--download-dir", default=None, help="model cache for hf:// models (default "
                   "~/.cache/stallfree/models or $STALLFREE_DOWNLOAD_DIR)")  # fmt: skip
    add_load_format_args(m)
    m.add_argument("--dtype", choices=DTYPES, default="auto", help="weights/activations/KV dtype (auto: "
                   "bfloat16 on CUDA (float16 without bf16) and on one CPU process, float32 on CPU worker "
                   "ranks (--tensor/--pipeline-parallel-size > 1); the same as LLM(); float32 is the exact "
                   "reference, docs/engine.md)")  # fmt: skip
    m.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default="auto", help="CPU, bf16: "
                   "weight-only int4/int8 linear layers (auto: int4 with bfloat16 in one CPU process, else "
                   "none)")  # fmt: skip
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS "
                   "if set, else every core this process may use)")  # fmt: skip
    m.add_argument("--max-model-len", type=int, default=None, help="context length: prompt + max_tokens "
                   "beyond it get 400 context_length_exceeded (default, and at most: the model's)")  # fmt: skip
    m.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None, help="the name(s) clients "
                   "send as `model`; the first is the one responses and metrics carry (default: the model "
                   "folder's or file's name)")  # fmt: skip
    m.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu or cuda[:N]")
    m.add_argument("--attention-backend", choices=("auto", *BACKENDS), default="auto", help="auto: on CUDA the "
                   "Triton kernels in bf16/fp16 and torch in fp32; on the CPU the C++ kernels (cpu, built once "
                   "per machine with g++, ~20 s), or torch without a compiler; flashinfer needs nvcc at first "
                   "use (docs/gpu.md)")  # fmt: skip
    m.add_argument("--enforce-eager", action="store_true", help="CUDA: run every iteration without CUDA "
                   "graphs (slower; for debugging)")  # fmt: skip
    m.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks (worker processes)"
    )
    m.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages; across pods the "
                   "ranks come from STALLFREE_NODE_RANK/NUM_NODES/LEADER_ADDRESS (docs/parallelism.md)")  # fmt: skip
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed for requests without their own, and of --load-format dummy weights",
    )
    s = p.add_argument_group("scheduling")
    s.add_argument("--policy", choices=POLICIES, default="sarathi", help="batching policy (default: sarathi)")
    s.add_argument("--token-budget", type=int, default=None, help="sarathi: alone, a fixed budget of tokens "
                   f"per iteration (the paper's); with --time-target, the cap of a time-budgeted iteration "
                   f"(default: time-budgeted, cap {DEFAULT_TIME_CAP}; {DEFAULT_TOKEN_BUDGET} for the other "
                   "policies); the traffic clusters file's tokenBudget overrides it")  # fmt: skip
    s.add_argument("--time-target", type=float, default=None, metavar="F",
                   help="sarathi: budget each iteration in time, F x the strictest P99 TBT SLO among the "
                   f"clusters decoding in it (default {DEFAULT_TIME_TARGET} unless --token-budget is given alone)")  # fmt: skip
    s.add_argument("--min-token-budget", type=int, default=None, metavar="N",
                   help="with a time target: tokens an iteration may always hold, whatever the prediction "
                   "(the floor; default 16)")  # fmt: skip
    s.add_argument("--default-tbt-slo", type=float, default=0.25, metavar="S",
                   help="with a time target: the P99 TBT of clusters that state none (default 0.25 s: worst "
                   "gaps a reader does not notice, ~4 tokens/s)")  # fmt: skip
    s.add_argument("--cost-model", metavar="FILE", default=None,
                   help="cost_model.json from `stallfree profile`: the time-budgeted scheduler's starting "
                   "model (default: a conservative built-in one); refitted from the engine's own iterations")  # fmt: skip
    s.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    s.add_argument("--chunk-align", type=int, default=0, help="round prefill chunks to this tile (0 = off)")
    s.add_argument("--chunk-context-scale", type=int, default=None, metavar="C",
                   help="sarathi: charge a prefill chunk for the context it attends over, n x (1 + mean "
                   "context / C) budget tokens, so chunks deep in long prompts shrink and iterations keep "
                   "their time; C = the context at which a token's attention costs as much as the rest of its "
                   "forward pass (`stallfree tune` measures it; default: off, the plain token count)")  # fmt: skip
    s.add_argument("--no-hybrid-batching", dest="hybrid_batching", action="store_false",
                   help="sarathi only: prefill chunks and decodes take turns instead of sharing iterations "
                   "(the paper's chunking-only ablation)")  # fmt: skip
    s.add_argument("--traffic-clusters", metavar="FILE", default=None, help="YAML/JSON traffic clusters file")
    s.add_argument("--traffic-cluster", metavar="SPEC", action="append", default=[],
                   help="a cluster inline, repeatable: name=chat,header=chat,chunkCap=256,maxWaiting=64,"
                   "maxRunning=32,priority=1,tbtP99Seconds=0.2,maxPromptTokens=2048")  # fmt: skip
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    c.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV-cache blocks (overrides the memory size)"
    )
    c.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV-cache size in GiB "
                   "(default: 1 GiB on CPU, half the free memory on GPU)")  # fmt: skip
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of full blocks of prompt prefixes seen before (default on; "
                   "--no-enable-prefix-caching recomputes every prompt)")  # fmt: skip
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    h.add_argument("--api-key", default=os.environ.get("STALLFREE_API_KEY"), help="require this API key")
    h.add_argument(
        "--admin-token", default=os.environ.get("STALLFREE_ADMIN_TOKEN"), help="admin bearer token"
    )
    h.add_argument("--stats-window", type=float, default=60.0, help="seconds of history in /admin/v1/stats")
    h.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    h.add_argument("--iteration-log", metavar="FILE", default=None, help="append one JSON line per engine "
                   "iteration (its chunks and timing) to FILE, to fit a cost model to this server with "
                   "`stallfree profile --from-log FILE`")  # fmt: skip
    h.add_argument("--tool-call-parser", choices=("auto", *TOOL_PARSERS), default="auto", help="how tool "
                   "calls are read from the model's output with tool_choice auto: hermes (<tool_call> "
                   "blocks, Hermes/Qwen) or llama3_json (Llama 3.1 JSON); auto picks it from the chat "
                   "template (hermes when the template has no tool format)")  # fmt: skip
    h.add_argument("--responses-store-size", type=int, default=1024, metavar="N", help="stored /v1/responses "
                   "(store: true, the default) for previous_response_id and GET/DELETE /v1/responses/{id}: kept "
                   "in this process's memory, at most N (the oldest forgotten first), lost on restart; 0 stores "
                   "none (default 1024)")  # fmt: skip
    h.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="S", help="seconds a stored "
                   "response is kept; after that (or once evicted) its id is a 404 (default 3600)")  # fmt: skip
    return p


def _fail(msg: str) -> int:
    print(f"stallfree serve: error: {msg}", file=sys.stderr)
    return 2


def default_threads() -> int:
    """OMP_NUM_THREADS when set (`stallfree up` and the benchmarks share cores that way), else every core
    this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def budget_mode(args: argparse.Namespace) -> tuple[int, float | None]:
    """(token budget, time target) from the flags: time-budgeted unless --token-budget is given alone or
    the policy is not sarathi (the baselines take a token budget)."""
    if args.token_budget is not None and args.token_budget < 1:
        raise ValueError(f"--token-budget must be >= 1, got {args.token_budget}")
    if args.time_target is not None and not 0 < args.time_target <= 1:
        raise ValueError(
            f"--time-target must be in (0, 1] (a share of the P99 TBT SLO), got {args.time_target}"
        )
    if args.min_token_budget is not None and args.min_token_budget < 1:
        raise ValueError(f"--min-token-budget must be >= 1, got {args.min_token_budget}")
    if not args.default_tbt_slo > 0:
        raise ValueError(f"--default-tbt-slo must be > 0 seconds, got {args.default_tbt_slo}")
    if args.cost_model is not None and not Path(args.cost_model).is_file():
        raise ValueError(
            f"--cost-model {args.cost_model}: no such file (`stallfree profile --out DIR` writes one)"
        )
    if args.policy != "sarathi":
        if args.time_target is not None:
            raise ValueError(
                f"--time-target budgets sarathi's iterations; --policy {args.policy} takes --token-budget"
            )
        return args.token_budget or DEFAULT_TOKEN_BUDGET, None
    if args.time_target is None and args.token_budget is not None:
        return args.token_budget, None
    return args.token_budget or DEFAULT_TIME_CAP, args.time_target or DEFAULT_TIME_TARGET


def build_configs(args: argparse.Namespace):
    """(EngineConfig, ServerSettings) from parsed arguments. Raises ValueError with a user-facing message."""
    from stallfree.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from stallfree.engine.paths import DEFAULT_MODEL_NAME
    from stallfree.engine.placement import resolve_placement
    from stallfree.engine.server.state import ServerSettings
    from stallfree.engine.server.traffic import (
        load_traffic_config,
        parse_cluster,
        parse_cluster_flag,
        parse_traffic_config,
    )

    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        v = getattr(args, flag)
        if v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size)
    if parallel.world_size > 1:
        from stallfree.engine.parallel.env import read_contract

        read_contract().ranks(parallel.world_size)  # a bad multi-node environment fails here, clearly
    budget, time_target = budget_mode(args)
    if args.responses_store_size < 0 or not args.responses_store_ttl > 0:
        raise ValueError(
            "--responses-store-size must be >= 0 and --responses-store-ttl > 0 seconds, got "
            f"{args.responses_store_size} and {args.responses_store_ttl}"
        )
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    served_names = tuple(args.served_model_name or ())
    if any(not n.strip() for n in served_names) or len(set(served_names)) != len(served_names):
        raise ValueError(f"--served-model-name takes distinct non-empty names, got {list(served_names)}")
    model, load_format = resolve_load_format(args.model, args.load_format, args.shape)
    if load_format == "auto" and model and model.startswith("hf://"):
        from stallfree.engine.hub import resolve_model  # noqa: PLC0415

        model = str(resolve_model(model, args.download_dir))
    if load_format == "auto" and model == DEFAULT_MODEL_NAME:
        model = None
    if load_format == "auto" and model is not None and not Path(model).expanduser().exists():
        raise ValueError(
            f"--model {model}: no such file or folder (give a .gguf file or a Hugging Face folder)"
        )
    if args.traffic_clusters:
        traffic = load_traffic_config(args.traffic_clusters, budget, args.chunk_align, time_target)
    else:
        traffic = parse_traffic_config({}, budget, args.chunk_align, time_target)
    if args.min_token_budget is not None:
        traffic = replace(traffic, min_token_budget=args.min_token_budget)
    if args.traffic_cluster:  # inline clusters replace same-named ones from the file
        flags = [
            parse_cluster(parse_cluster_flag(f), f"--traffic-cluster[{i}]")
            for i, f in enumerate(args.traffic_cluster)
        ]
        names = {c.name for c in flags}
        kept = tuple(c for c in traffic.clusters if c.name not in names)
        traffic = replace(traffic, clusters=(*kept, *flags))
    # a bad device / dtype / quantization combination fails here; the engine resolves `auto` the same way
    resolve_placement(args.device, args.dtype, args.quantization, world_size=parallel.world_size)
    engine_config = EngineConfig(
        model=model,
        load_format=load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        threads=args.threads or default_threads(),
        device=args.device,
        attention_backend=args.attention_backend,
        cuda_graphs=not args.enforce_eager,
        max_model_len=args.max_model_len,
        seed=args.seed,
        parallel=parallel,
        scheduler=SchedulerConfig(
            policy=args.policy,
            max_num_seqs=args.max_num_seqs,
            chunk_align=traffic.chunk_align,
            hybrid_batching=args.hybrid_batching,
            chunk_context_scale=args.chunk_context_scale,
            default_tbt_slo=args.default_tbt_slo,
            tunables=traffic.tunables(),
        ),
        cost_model=args.cost_model,
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        admin_token=args.admin_token or None,
        traffic=traffic,
        stats_window_s=args.stats_window,
        drain_timeout_s=args.drain_timeout,
        iteration_log=args.iteration_log,
        served_model_names=served_names,
        tool_call_parser=args.tool_call_parser,
        responses_store_size=args.responses_store_size,
        responses_store_ttl_s=args.responses_store_ttl,
    )
    return engine_config, settings


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine_config, settings = build_configs(args)
    except ValueError as e:
        return _fail(str(e))

    world = engine_config.parallel.world_size
    if world > 1:
        from stallfree.engine.parallel.env import read_contract

        contract = read_contract()
        if not contract.is_leader:  # a follower pod: run this node's ranks, serve no HTTP
            from stallfree.engine.parallel.executor import run_remote_ranks

            return run_remote_ranks(contract, world)

    import uvicorn

    from stallfree.engine.engine import create_engine
    from stallfree.engine.server.app import build_app

    app = build_app(settings, lambda: create_engine(engine_config))
    state = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.engine is not None and not state.engine.draining:
                logger.info("signal %s: no longer admitting requests; draining", sig)
                state.engine.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
        log_config=None,
    )
    server = _Server(config)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    # uvicorn re-raises the signal it caught once it has shut down; with these no-op handlers in place
    # that re-raise is harmless, so a drained server exits 0 instead of dying by SIGTERM.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if state.load_error is not None:
        print(f"stallfree serve: error: {state.load_error}", file=sys.stderr)
        return 1
    return 0
