"""`python -m experiments.engine_bench`: the engine's own costs on this machine, as ratios measured side by side.

  chunking   prefill time of one prompt under token budgets 128..2048, relative to one-shot prefill
  decode     time per decode iteration for batch sizes 1..64
  hybrid     a batch of decodes riding along a prefill chunk vs decode-only and prefill-only batches
  overhead   share of each iteration spent outside the model forward at N running decodes

With --device cuda (and usually --load-format dummy --shape llama3-8b) it measures the GPU path instead:
decode at batch 1/32/128, one-shot and chunked prefill of 4096 tokens, a hybrid iteration, kernel launches
and host syncs per iteration, each beside its memory or compute floor (experiments.engine_bench_gpu).

Configurations are interleaved round-robin and repeated, and medians are reported, because this box is
shared and noisy. Results: JSON + PNG plots in --out, and a table on the terminal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from stallfree.bench import profile
from stallfree.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulerTunables
from stallfree.engine.engine import LLMEngine
from stallfree.engine.sampling_params import SamplingParams

ONE_SHOT = 1 << 20


def _engine(loaded, budget: int, policy: str = "sarathi", blocks: int = 2048) -> LLMEngine:
    weights = next(loaded.model.parameters())  # the KV cache takes the model's dtype
    cfg = EngineConfig(
        dtype=str(weights.dtype).removeprefix("torch."),
        scheduler=SchedulerConfig(
            policy=policy, max_num_seqs=256, tunables=SchedulerTunables(token_budget=budget)
        ),
        cache=CacheConfig(
            num_kv_blocks=blocks, enable_prefix_caching=False
        ),  # NOTE: repeated prompts must be computed, not served from the prefix cache
    )
    return LLMEngine(cfg, loaded=loaded)


def synthetic_ids(engine: LLMEngine, n: int, salt: int = 0) -> list[int]:
    """The profiler's synthetic prompt ids for this engine's vocabulary."""
    return profile.synthetic_ids(engine.model_config.vocab_size, n, salt)


def prefill_time(engine: LLMEngine, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds to prefill an n-token prompt and sample its first token, under the engine's budget.

    NOTE: with one torch thread the step runs on this thread, so its CPU time is the work itself and is
    not inflated by other processes on a shared box, unlike wall time.
    """
    engine.add_request("p", synthetic_ids(engine, n), SamplingParams(max_tokens=1, temperature=0.0))
    t0, c0 = time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0, time.thread_time() - c0


def decode_iterations(engine: LLMEngine, batch: int, context: int, steps: int, extra_prompt: int = 0):
    """Start `batch` requests with `context`-token prompts, let them reach decode, then record `steps`
    iterations. With extra_prompt > 0 a long prompt arrives once they decode, so iterations are hybrid."""
    sp = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{b}", synthetic_ids(engine, context, salt=b + 1), sp)
    while any(not r.in_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    if extra_prompt:
        engine.add_request(
            "long", synthetic_ids(engine, extra_prompt, salt=999), SamplingParams(max_tokens=1)
        )
    stats = []
    for _ in range(steps):
        c0 = time.thread_time()
        engine.step()
        stats.append((engine.last_stats, time.thread_time() - c0))
    for rid in [r.request_id for r in engine.scheduler.running + engine.scheduler.waiting]:
        engine.abort_request(rid)
    return stats


def bench_chunking(loaded, lengths, budgets, reps, bar) -> dict:
    engines = {b: _engine(loaded, b) for b in [*budgets, ONE_SHOT]}
    wall: dict[int, dict[int, list[float]]] = {n: {b: [] for b in engines} for n in lengths}
    cpu: dict[int, dict[int, list[float]]] = {n: {b: [] for b in engines} for n in lengths}
    for _ in range(reps):
        for n in lengths:
            for b, eng in engines.items():  # round-robin: every config sees the same background noise
                w, c = prefill_time(eng, n)
                wall[n][b].append(w)
                cpu[n][b].append(c)
                bar.update(1)
    out = {}
    for n in lengths:
        base, base_cpu = statistics.median(wall[n][ONE_SHOT]), statistics.median(cpu[n][ONE_SHOT])
        out[str(n)] = {
            "one_shot_s": base,
            "one_shot_cpu_s": base_cpu,
            "ratio": {str(b): statistics.median(cpu[n][b]) / base_cpu for b in budgets},
            "wall_ratio": {str(b): statistics.median(wall[n][b]) / base for b in budgets},
            "median_s": {str(b): statistics.median(wall[n][b]) for b in budgets},
            "median_cpu_s": {str(b): statistics.median(cpu[n][b]) for b in budgets},
        }
    return out


def bench_decode(loaded, batches, context, steps, bar) -> dict:
    out = {}
    for b in batches:
        eng = _engine(loaded, 4096)
        st = decode_iterations(eng, b, context, steps)
        t = statistics.median(c for _, c in st)
        out[str(b)] = {
            "iteration_s": t,
            "per_token_s": t / b,
            "iteration_wall_s": statistics.median(s.time_total for s, _ in st),
            "overhead_share": statistics.median(s.overhead_share for s, _ in st),
        }
        bar.update(1)
    return out


def bench_hybrid(loaded, decodes, chunk, context, steps, bar) -> dict:
    dec = decode_iterations(_engine(loaded, 4096), decodes, context, steps)
    bar.update(1)
    hyb = decode_iterations(
        _engine(loaded, decodes + chunk), decodes, context, steps, extra_prompt=chunk * (steps + 2)
    )
    bar.update(1)
    pre = decode_iterations(_engine(loaded, chunk), 0, context, steps, extra_prompt=chunk * (steps + 2))
    bar.update(1)
    med = lambda st: statistics.median(c for _, c in st)  # noqa: E731 - CPU seconds per iteration
    d, h, p = med(dec), med(hyb), med(pre)
    return {
        "decodes": decodes,
        "chunk": chunk,
        "context": context,
        "decode_only_s": d,
        "prefill_only_s": p,
        "hybrid_s": h,
        "hybrid_vs_sum": h / (d + p),
        "hybrid_vs_prefill_only": h / p,
    }


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, row in result["chunking"].items():
        budgets = [int(b) for b in row["ratio"]]
        ax.plot(budgets, list(row["ratio"].values()), marker="o", label=f"prompt {n}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget (chunk size)")
    ax.set_ylabel("prefill CPU time / one-shot")
    ax.set_title("Chunked prefill overhead")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "chunking.png", dpi=120)
    files.append("chunking.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [int(b) for b in result["decode"]]
    ax.plot(bs, [v["iteration_s"] * 1e3 for v in result["decode"].values()], marker="o", label="iteration")
    ax.plot(bs, [v["per_token_s"] * 1e3 for v in result["decode"].values()], marker="s", label="per token")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("CPU ms")
    ax.set_title("Decode cost vs batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)
    files.append("decode.png")
    plt.close("all")
    return files


def _table(result: dict) -> str:
    lines = ["chunked prefill CPU time / one-shot (median; wall-time ratios are in the JSON)"]
    budgets = list(next(iter(result["chunking"].values()))["ratio"])
    lines.append("prompt  one-shot CPU s  " + "  ".join(f"{b:>6}" for b in budgets))
    for n, row in result["chunking"].items():
        lines.append(
            f"{n:>6}  {row['one_shot_cpu_s']:>14.3f}  "
            + "  ".join(f"{v:>6.3f}" for v in row["ratio"].values())
        )
    lines.append("\ndecode (CPU time): batch  iteration ms  per-token ms  overhead share")
    for b, v in result["decode"].items():
        lines.append(
            f"       {b:>5}  {v['iteration_s'] * 1e3:>12.1f}  {v['per_token_s'] * 1e3:>12.2f}  {v['overhead_share']:>14.1%}"
        )
    h = result["hybrid"]
    lines.append(
        f"\nhybrid (CPU time): {h['decodes']} decodes + {h['chunk']}-token chunk: {h['hybrid_s'] * 1e3:.1f} ms; decode-only "
        f"{h['decode_only_s'] * 1e3:.1f} ms; prefill-only {h['prefill_only_s'] * 1e3:.1f} ms; "
        f"hybrid / (decode + prefill) = {h['hybrid_vs_sum']:.2f}; hybrid / prefill-only = {h['hybrid_vs_prefill_only']:.2f}"
    )
    o = result["overhead"]
    lines.append(
        f"\nengine overhead at {o['decodes']} running decodes: {o['share']:.1%} of each iteration "
        f"(schedule {o['schedule_ms']:.2f} ms, prepare {o['prepare_ms']:.2f} ms, sample {o['sample_ms']:.2f} ms, "
        f"update {o['update_ms']:.2f} ms; forward {o['forward_ms']:.1f} ms)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.engine_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M)")
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths for the chunking figure")
    ap.add_argument(
        "--budgets", default="128,256,512,1024,2048", help="token budgets for the chunking figure"
    )
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each chunking measurement")
    ap.add_argument("--steps", type=int, default=12, help="iterations measured per decode configuration")
    ap.add_argument("--overhead-decodes", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared 2-core box)"
    )
    ap.add_argument("--out", default="results/engine-bench", help="folder for JSON and plots")
    g = ap.add_argument_group("GPU (--device cuda: decode/prefill/hybrid against their floors, docs/gpu.md)")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    g.add_argument("--dtype", default="auto", help="cuda: auto (bfloat16), bfloat16, float16 or float32; "
                   "cpu: auto (bfloat16, engine.placement's rule), float32 or bfloat16")  # fmt: skip
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4"), help="cpu with "
                    "--dtype bfloat16: weight-only linear layers")  # fmt: skip
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights of --shape"
    )
    g.add_argument("--shape", default="llama3-8b", help="dummy shape: a named shape or an HF config.json")
    g.add_argument("--backends", default="triton,torch", help="cuda: attention backends to measure, in order")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from experiments.engine_bench_gpu import main as gpu_main  # noqa: PLC0415

        if args.out == "results/engine-bench":
            args.out = "results/gpu"
        return gpu_main(args)
    if args.load_format == "dummy":
        ap.error("--load-format dummy is for --device cuda here; on CPU the bundled model is measured")

    import torch

    from stallfree.engine.model.loader import load_model

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype=dtype, quantization=args.quantization)
    total = args.reps * len(lengths) * (len(budgets) + 1) + len(batches) + 3 + 1
    with tqdm(total=total, desc="engine-bench", file=sys.stderr) as bar:
        result = {
            "model": loaded.name,
            "threads": args.threads,
            "device": "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": args.quantization,
            "chunking": bench_chunking(loaded, lengths, budgets, args.reps, bar),
            "decode": bench_decode(loaded, batches, args.context, args.steps, bar),
            "hybrid": bench_hybrid(loaded, 16, 512, args.context, args.steps, bar),
        }
        st = decode_iterations(_engine(loaded, 4096), args.overhead_decodes, args.context, args.steps)
        bar.update(1)
    med = lambda f: statistics.median(f(s) for s, _ in st) * 1e3  # noqa: E731
    result["overhead"] = {
        "decodes": args.overhead_decodes,
        "share": statistics.median(s.overhead_share for s, _ in st),
        "schedule_ms": med(lambda s: s.time_schedule),
        "prepare_ms": med(lambda s: s.time_prepare),
        "forward_ms": med(lambda s: s.time_forward),
        "sample_ms": med(lambda s: s.time_sample),
        "update_ms": med(lambda s: s.time_update),
    }
    (out / "engine-bench.json").write_text(json.dumps(result, indent=2))
    files = _plots(result, out)
    print(_table(result))
    print(f"\nsaved {out / 'engine-bench.json'} and {', '.join(str(out / f) for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
