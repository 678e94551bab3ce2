"""`python -m experiments.engine_bench --device cuda`: the engine's iteration costs on a GPU, each beside its floor.

  decode     one decode iteration at batch 1 / 32 / 128, context 1024 (CUDA graphs on the default backend)
  prefill    a 4096-token prompt in one iteration, and under token budgets 512 / 1024 / 2048 (chunked)
  hybrid     32 decodes riding a 512-token chunk, over the same chunk alone
  launches   kernels launched and host synchronisations per iteration (torch profiler), decode and hybrid

Floors: a decode step reads every weight (the input embedding table excepted: only B rows of it) and the
whole KV history once, at the device's copy bandwidth measured here; a prefill does 2 x (weights per token)
FLOPs per token plus causal attention, at 790 TFLOP/s (GPU.md: the bf16 matrix rate measured on this H200).
Every time is the median of --reps timed iterations after warm-up, wall clock around engine.step() with the
device synchronised (the engine synchronises once per iteration itself).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from experiments.engine_bench import synthetic_ids
from stallfree.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulerTunables
from stallfree.engine.engine import LLMEngine
from stallfree.engine.model.loader import LoadedModel
from stallfree.engine.sampling_params import SamplingParams

MATMUL_TFLOPS = 790.0  # bf16, measured on the H200 (../shared/GPU.md); floors use it


@dataclass(frozen=True, slots=True)
class Plan:
    """What to measure (the issue's figures by default; tests shrink it)."""

    batches: tuple[int, ...] = (1, 32, 128)
    context: int = 1024
    prompt: int = 4096
    budgets: tuple[int, ...] = (512, 1024, 2048)
    hybrid_decodes: int = 32
    hybrid_chunk: int = 512
    device: str = "cuda"


def _sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read + write), median of `reps`."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n * 2 / statistics.median(times[1:])


class Floors:
    """Memory and compute floors of one model on this device."""

    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, bandwidth: float) -> None:
        cfg = loaded.config
        elt = torch.empty((), dtype=dtype).element_size()
        embed = cfg.vocab_size * cfg.hidden_size
        params = loaded.model.num_params()
        self.weight_bytes = (params - (0 if cfg.tie_word_embeddings else embed)) * elt  # read per step
        self.layer_params = params - embed * (1 if cfg.tie_word_embeddings else 2)  # per-token matmul weights
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(elt)
        self.cfg = cfg
        self.bandwidth = bandwidth

    def decode_ms(self, batch: int, context: int) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth * 1e3

    def prefill_ms(self, n: int) -> float:
        c = self.cfg
        # causal attention: QK^T and PV, 2 FLOPs per multiply-add, n(n+1)/2 query-key pairs per head
        attn = 2 * 2 * (n * (n + 1) / 2) * c.head_dim * c.num_heads * c.num_layers
        return (2 * self.layer_params * n + attn) / (MATMUL_TFLOPS * 1e12) * 1e3


def _timed_step(engine: LLMEngine, plan: Plan) -> float:
    _sync(plan)
    t0 = time.perf_counter()
    engine.step()
    _sync(plan)
    return time.perf_counter() - t0


def _drain(engine: LLMEngine) -> None:
    for r in [r.request_id for r in engine.scheduler.running + engine.scheduler.waiting]:
        engine.abort_request(r)


def _start_decodes(engine: LLMEngine, batch: int, context: int) -> None:
    sp = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{b}", synthetic_ids(engine, context, b + 1), sp)
    while any(not r.in_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def bench_decode(engine: LLMEngine, floors: Floors, reps: int, plan: Plan) -> dict:
    out = {}
    engine.set_tunables(SchedulerTunables(token_budget=8192))
    for batch in plan.batches:
        _start_decodes(engine, batch, plan.context)
        for _ in range(3):
            engine.step()  # warm
        times = [_timed_step(engine, plan) for _ in range(reps)]
        _drain(engine)
        ms = statistics.median(times) * 1e3
        out[str(batch)] = {"ms": ms, "floor_ms": floors.decode_ms(batch, plan.context + 3 + reps // 2)}
    return out


def _prefill_once(engine: LLMEngine, budget: int, salt: int, plan: Plan) -> tuple[float, list[float]]:
    """Wall time to prefill one plan.prompt-token prompt (and sample its first token); per-iteration times."""
    engine.set_tunables(SchedulerTunables(token_budget=budget))
    ids = synthetic_ids(engine, plan.prompt, salt)
    engine.add_request(f"p{salt}", ids, SamplingParams(max_tokens=1))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(_timed_step(engine, plan))
    return sum(steps), steps


def bench_prefill(engine: LLMEngine, floors: Floors, reps: int, plan: Plan) -> dict:
    budgets = [plan.prompt, *plan.budgets]
    times: dict[int, list[float]] = {b: [] for b in budgets}
    _prefill_once(engine, plan.prompt, 0, plan)  # warm
    for r in range(reps):
        for b in budgets:  # round-robin: every budget sees the same conditions
            times[b].append(_prefill_once(engine, b, 1 + r, plan)[0])
    one = statistics.median(times[plan.prompt])
    return {
        "prefill_4096_ms": one * 1e3,
        "prefill_4096_floor_ms": floors.prefill_ms(plan.prompt),
        "chunked_ms": {str(b): statistics.median(times[b]) * 1e3 for b in plan.budgets},
        "chunked_over_oneshot": {str(b): statistics.median(times[b]) / one for b in plan.budgets},
    }


def bench_hybrid(engine: LLMEngine, reps: int, plan: Plan) -> dict:
    """Iterations of decodes plus a chunk vs the same chunks alone (same positions, same prompt)."""
    decodes, chunk = plan.hybrid_decodes, plan.hybrid_chunk
    alone, hybrid = [], []
    for r in range(reps):
        _, steps = _prefill_once(engine, chunk, 100 + r, plan)
        alone.append(steps[:-1])  # the last iteration also samples; compare the chunk iterations
        engine.set_tunables(SchedulerTunables(token_budget=8192))
        _start_decodes(engine, decodes, plan.context)
        engine.set_tunables(SchedulerTunables(token_budget=decodes + chunk))
        engine.add_request("long", synthetic_ids(engine, plan.prompt, 100 + r), SamplingParams(max_tokens=1))
        steps = []
        while engine.scheduler.get("long") is not None:
            steps.append(_timed_step(engine, plan))
        hybrid.append(steps[:-1])
        _drain(engine)
    a = statistics.median(t for s in alone for t in s)
    h = statistics.median(t for s in hybrid for t in s)
    return {
        "decodes": decodes,
        "chunk": chunk,
        "chunk_alone_ms": a * 1e3,
        "hybrid_ms": h * 1e3,
        "hybrid_over_chunk": h / a,
    }


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def count_launches(engine: LLMEngine, plan: Plan) -> dict:
    """Kernel launches, graph launches and host synchronisations in one decode and one hybrid iteration."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    def counts(step) -> dict:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            _sync(plan)
        events = prof.events()
        names = [e.name for e in events]
        # NOTE: cudaDeviceSynchronize is this harness's own wait (the engine never calls it).
        top = sorted(
            (e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0),
            key=lambda e: -e.device_time_total,
        )[:12]
        return {
            "kernels_run": sum(str(e.device_type).endswith("CUDA") for e in events),
            "kernel_launches": sum(n in LAUNCHES for n in names),
            "graph_launches": sum(n == "cudaGraphLaunch" for n in names),
            "stream_syncs": sum(n == "cudaStreamSynchronize" for n in names),
            "event_syncs": sum(n == "cudaEventSynchronize" for n in names),
            "memcpy": sum(n.startswith("cudaMemcpy") for n in names),
            "gpu_ms_top_kernels": {e.key[:80]: e.device_time_total / 1e3 for e in top},
        }

    engine.set_tunables(SchedulerTunables(token_budget=8192))
    _start_decodes(engine, plan.hybrid_decodes, plan.context)
    engine.step()
    decode = counts(engine.step)
    engine.set_tunables(SchedulerTunables(token_budget=plan.hybrid_decodes + plan.hybrid_chunk))
    ids = synthetic_ids(engine, plan.prompt, 7)
    engine.add_request("long", ids, SamplingParams(max_tokens=1))
    engine.step()
    hybrid = counts(engine.step)
    _drain(engine)
    return {
        f"decode_{plan.hybrid_decodes}": decode,
        f"hybrid_{plan.hybrid_decodes}_plus_{plan.hybrid_chunk}": hybrid,
    }


def run_backend(
    loaded: LoadedModel, dtype: str, backend: str, floors: Floors, reps: int, bar, plan: Plan
) -> dict:
    blocks = (max(plan.batches) * (plan.context + 64) + 3 * plan.prompt) // 16 + 64
    # "triton-eager-hybrid": the Triton backend with hybrid/prefill iterations eager (no piecewise graphs)
    eager_hybrid = backend.endswith("-eager-hybrid")
    cfg = EngineConfig(
        dtype=dtype,
        device=plan.device,
        attention_backend=backend.removesuffix("-eager-hybrid"),
        max_graph_tokens=0 if eager_hybrid else 1024,
        scheduler=SchedulerConfig(
            policy="sarathi", max_num_seqs=128, tunables=SchedulerTunables(token_budget=8192)
        ),
        cache=CacheConfig(
            num_kv_blocks=blocks, enable_prefix_caching=False
        ),  # NOTE: repeated prompts must be computed, not served from the prefix cache
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, loaded=loaded)
    name = engine.executor.runner.backend.name + ("-eager-hybrid" if eager_hybrid else "")
    row: dict = {"backend": name, "startup_s": time.perf_counter() - t0}
    row["cuda_graphs"] = getattr(engine.executor.runner, "graphs", None) is not None
    row["piecewise_graphs"] = getattr(engine.executor.runner, "piecewise", None) is not None
    decode = bench_decode(engine, floors, reps, plan)
    bar.update(1)
    row["decode_ms"] = {b: v["ms"] for b, v in decode.items()}
    row["decode_floor_ms"] = {b: v["floor_ms"] for b, v in decode.items()}
    row["decode_over_floor"] = {b: v["ms"] / v["floor_ms"] for b, v in decode.items()}
    row.update(bench_prefill(engine, floors, max(3, reps // 4), plan))
    row["prefill_over_floor"] = row["prefill_4096_ms"] / row["prefill_4096_floor_ms"]
    bar.update(1)
    hybrid = bench_hybrid(engine, max(2, reps // 8), plan)
    row["hybrid"] = hybrid
    row["hybrid_over_chunk"] = hybrid["hybrid_over_chunk"]
    bar.update(1)
    row["launches"] = count_launches(engine, plan)
    bar.update(1)
    del engine
    gc.collect()
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return row


def table(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['device_name']}, {result['dtype']}; copy bandwidth "
        f"{result['bandwidth_tb_s']:.2f} TB/s, matmul {MATMUL_TFLOPS:.0f} TFLOP/s"
    ]
    for row in result["backends"].values():
        lines.append(f"\n[{row['backend']}] start-up (kernels, graphs) {row['startup_s']:.1f} s")
        lines.append("  decode, context 1024:  batch   ms    floor ms   x floor")
        for b, ms in row["decode_ms"].items():
            fl = row["decode_floor_ms"][b]
            lines.append(f"                        {b:>5} {ms:7.2f} {fl:9.2f} {ms / fl:8.2f}")
        lines.append(
            f"  prefill 4096 one-shot: {row['prefill_4096_ms']:.1f} ms (floor {row['prefill_4096_floor_ms']:.1f} ms, "
            f"{row['prefill_over_floor']:.2f}x)"
        )
        lines.append(
            "  chunked over one-shot: "
            + ", ".join(f"budget {b}: {v:.3f}x" for b, v in row["chunked_over_oneshot"].items())
        )
        h = row["hybrid"]
        lines.append(
            f"  hybrid: {h['decodes']} decodes + {h['chunk']}-token chunk {h['hybrid_ms']:.2f} ms vs chunk alone "
            f"{h['chunk_alone_ms']:.2f} ms: {h['hybrid_over_chunk']:.3f}x"
        )
        for k, v in row["launches"].items():
            lines.append(f"  per iteration ({k}): {v}")
    return "\n".join(lines)


def main(args, plan: Plan | None = None) -> int:
    """Run from `python -m experiments.engine_bench --device cuda` (experiments.engine_bench parses the arguments).

    A test passes a small `plan` with device "cpu" (Triton's interpreter) to check the harness itself."""
    from stallfree.engine.model.loader import load_model  # noqa: PLC0415
    from stallfree.engine.placement import resolve_placement  # noqa: PLC0415

    plan = plan or Plan()
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("engine-bench --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(plan.device)
    dtype = resolve_placement(plan.device, args.dtype, "none").dtype
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth(device) if plan.device == "cuda" else 1e10
    spec = args.shape if args.load_format == "dummy" else args.model
    max_len = max(8192, plan.prompt + 64)
    loaded = load_model(spec, dtype=dtype, device=device, load_format=args.load_format, max_model_len=max_len)
    floors = Floors(loaded, dtype, bandwidth)
    backends = [b for b in args.backends.split(",") if b]
    result = {
        "model": loaded.name,
        "params": loaded.model.num_params(),
        "device_name": torch.cuda.get_device_name(device) if plan.device == "cuda" else plan.device,
        "dtype": str(dtype).removeprefix("torch."),
        "bandwidth_tb_s": bandwidth / 1e12,
        "matmul_tflops": MATMUL_TFLOPS,
        "torch": torch.__version__,
        # what was timed, for readers of the figures (stallfree.bench.figuresfit fits a cost model to them)
        "plan": {**asdict(plan), "decode_steps": args.steps},
        "backends": {},
    }
    with tqdm(total=4 * len(backends), desc="engine-bench (cuda)", file=sys.stderr) as bar:
        for b in backends:
            try:
                result["backends"][b] = run_backend(loaded, result["dtype"], b, floors, args.steps, bar, plan)
            except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others' figures
                print(f"backend {b} failed: {type(e).__name__}: {e}", file=sys.stderr)
                result["backends"][b] = {"backend": b, "error": f"{type(e).__name__}: {e}"}
            (out / "engine.json").write_text(json.dumps(_summary(result), indent=2))
    ok = {k: v for k, v in result["backends"].items() if "error" not in v}
    print(table({**result, "backends": ok}))
    print(f"\nsaved {out / 'engine.json'}")
    return 0 if ok else 1


def _summary(result: dict) -> dict:
    """The issue's keys at the top level for the first backend that ran, every backend under 'backends'."""
    first = next((v for v in result["backends"].values() if "error" not in v), None)
    keys = ("backend", "decode_ms", "decode_floor_ms", "prefill_4096_ms", "prefill_4096_floor_ms",
            "chunked_over_oneshot", "hybrid_over_chunk")  # fmt: skip
    top = {k: first[k] for k in keys} if first else {}
    return {**top, **result}
