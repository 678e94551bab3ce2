"""`python -m experiments.structured_cost`: what structured outputs cost a decode batch, constrained vs not, side by side.

One engine on the bundled model (CPU unless --device), decode-only iterations at --batch requests with
--context-token prompts, in two configurations that alternate within every repetition (the box is shared:
both see the same background):
  plain        every request unconstrained
  constrained  --constrained of them under a JSON schema (an array of at least 1000 small objects, so the
               grammar cannot end inside the timed steps and its masks mix structural and free-text states)
Per iteration it records the wall time of Engine.step() (mask fill, forward, masking, sampling, matcher
updates), the process CPU time and the sampler's share. Medians and spread over repetitions x steps;
ratio = constrained / plain of the median ms per token. Results: structured_cost.json (+ a box plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
}


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "p25": q[0],
        "p75": q[2],
        "min": min(values),
        "max": max(values),
    }


def run_config(
    engine, batch: int, constrained: int, context: int, steps: int, salt: int
) -> list[dict[str, float]]:
    """Start `batch` decodes (the first `constrained` under SCHEMA), reach decode, time `steps` steps."""
    from experiments.engine_bench import synthetic_ids
    from stallfree.engine.sampling_params import SamplingParams
    from stallfree.engine.structured import StructuredOutputsParams

    plain = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    so = SamplingParams(
        max_tokens=100_000, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    for b in range(batch):
        engine.add_request(
            f"r{salt}-{b}",
            synthetic_ids(engine, context, salt=salt * 1000 + b),
            so if b < constrained else plain,
        )
    while any(not r.in_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    rows = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if len(outs) != batch or any(o.finished for o in outs):
            raise RuntimeError(
                "a request finished inside the timed steps: raise max_tokens or the schema's minItems"
            )
        rows.append({"wall": wall, "cpu": cpu, "sample": engine.last_stats.time_sample})
    for r in [r.request_id for r in engine.scheduler.running + engine.scheduler.waiting]:
        engine.abort_request(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.structured_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--batch", type=int, default=32, help="decoding requests per iteration (default 32)")
    ap.add_argument("--constrained", type=int, default=8, help="how many of them are constrained (default 8)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode iterations per configuration and rep")
    ap.add_argument(
        "--reps", type=int, default=5, help="repetitions; the two configurations alternate in each"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadiest on a shared box)"
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--out", default="results/structured-outputs", help="folder for structured_cost.json")
    ap.add_argument("--no-plot", action="store_true", help="skip the box plot")
    args = ap.parse_args(argv)
    if not 0 < args.constrained <= args.batch:
        ap.error("--constrained must be in [1, --batch]")

    import torch

    from stallfree.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulerTunables
    from stallfree.engine.engine import LLMEngine
    from stallfree.engine.model.loader import load_model

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    loaded = load_model(None, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, device=device)
    engine = LLMEngine(
        EngineConfig(
            device=args.device,
            scheduler=SchedulerConfig(max_num_seqs=args.batch, tunables=SchedulerTunables(token_budget=4096)),
            cache=CacheConfig(num_kv_blocks=2048, enable_prefix_caching=False),
        ),
        loaded=loaded,
    )
    configs = {"plain": 0, "constrained": args.constrained}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    run_config(engine, args.batch, args.constrained, args.context, 2, salt=0)  # warm-up: kernels, grammar
    for rep in range(args.reps):
        for name, n in configs.items():
            rows[name] += run_config(
                engine, args.batch, n, args.context, args.steps, salt=rep * 2 + 1 + (n > 0)
            )
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    result: dict = {
        "batch": args.batch, "constrained": args.constrained, "context": args.context, "steps": args.steps,
        "reps": args.reps, "threads": args.threads, "device": str(device), "schema": SCHEMA, "configs": {},
    }  # fmt: skip
    for name, rs in rows.items():
        result["configs"][name] = {
            "iterations": len(rs),
            "ms_per_token": _spread([r["wall"] * 1e3 / args.batch for r in rs]),
            "cpu_ms_per_token": _spread([r["cpu"] * 1e3 / args.batch for r in rs]),
            "sample_ms_per_iteration": _spread([r["sample"] * 1e3 for r in rs]),
            "iterations_s": rs,  # every timed iteration: wall, process CPU and sampler seconds
        }
    c = result["configs"]
    result["ratio"] = c["constrained"]["ms_per_token"]["median"] / c["plain"]["ms_per_token"]["median"]
    result["cpu_ratio"] = (
        c["constrained"]["cpu_ms_per_token"]["median"] / c["plain"]["cpu_ms_per_token"]["median"]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_cost.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"decode at batch {args.batch}, {args.constrained} constrained vs none; {device}, {args.threads} thread(s), "
          f"{args.reps} reps x {args.steps} steps; median [p25, p75]")  # fmt: skip
    for name, r in c.items():
        w, cpu, s = r["ms_per_token"], r["cpu_ms_per_token"], r["sample_ms_per_iteration"]
        print(f"  {name:12s} {w['median']:7.3f} ms/token [{w['p25']:.3f}, {w['p75']:.3f}]  "
              f"cpu {cpu['median']:7.3f} ms/token  sampler {s['median']:6.2f} ms/iteration")  # fmt: skip
    print(f"  ratio constrained/plain: {result['ratio']:.3f} (wall), {result['cpu_ratio']:.3f} (CPU)")
    if not args.no_plot:
        _plot(rows, args, out / "structured_cost.png")
    print(f"wrote {out / 'structured_cost.json'}")
    return 0


def _plot(rows: dict[str, list[dict[str, float]]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    labels = [f"{n}\n({args.constrained if n != 'plain' else 0} of {args.batch})" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in ((axes[0], "wall", "wall time"), (axes[1], "cpu", "process CPU time")):
        ax.boxplot([[r[key] * 1e3 / args.batch for r in rows[n]] for n in names], showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), labels)
        ax.set_ylabel("decode ms per token")
        ax.set_title(title)
    fig.suptitle(f"Structured outputs: decode at batch {args.batch}, {args.threads} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
