"""Pipeline bubbles: iteration-time variance across micro-batches and pipeline idle share, per policy.

    python -m experiments.pp_bubbles --pp 2 --policies sarathi vllm --out docs/figures/pp_bubbles.json

Replays requests from a trace (lengths scaled, default /8 for CPU) on one T x P engine, once per policy
(the workers and KV cache are reused; only the scheduler changes). Offline: every request is submitted
at t=0 (the trace gives lengths only), so the pipeline is always full, and reads every rank's per-micro-batch
timings. Definitions:
  stage compute time   seconds a stage spends computing one micro-batch (waits for the previous stage
                       or for the next stage to take its output are excluded)
  CV                   std / mean of stage 0's compute time over micro-batches: how uneven they are
  idle share           1 - (sum over stages of compute time) / (P x wall time of the run): the fraction of
                       stage-time lost to bubbles (and to the leader's scheduling gaps)
Prints a table and saves JSON (+ a PNG timeline when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from stallfree.engine import LLM, SamplingParams

logger = logging.getLogger(__name__)
SUMMARIZATION = "arxiv"  # arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.pp_bubbles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--trace", default=SUMMARIZATION, help="trace name or CSV path (default: summarization)")
    p.add_argument("--scale", type=float, default=0.125, help="length scale for CPU (default 1/8)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=["sarathi", "vllm"])
    p.add_argument("--token-budget", type=int, default=128, help="sarathi's per-iteration token budget")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pp_bubbles.json", help="JSON output (a .png beside it)")
    return p


def summarize(records: dict[int, list], tp: int, pp: int, first_mb: int, last_mb: int) -> dict:
    """Per-stage compute times of micro-batches [first_mb, last_mb) -> the figures (tensor rank 0 of each stage)."""
    stages = []
    for s in range(pp):
        recs = [r for r in records[s * tp] if first_mb <= r[0] < last_mb]
        stages.append(recs)
    start = min(r[2] for r in stages[0])
    end = max(r[5] for r in stages[-1])
    wall = end - start
    compute = [np.array([r[4] - r[3] for r in recs]) for recs in stages]
    tokens = np.array([r[1] for r in stages[0]])
    c0 = compute[0]
    return {
        "micro_batches": len(c0),
        "wall_s": wall,
        "tokens_per_micro_batch_mean": float(tokens.mean()),
        "tokens_per_micro_batch_cv": float(tokens.std() / tokens.mean()),
        "stage0_compute_ms_mean": float(c0.mean() * 1e3),
        "stage0_compute_ms_p50": float(np.percentile(c0, 50) * 1e3),
        "stage0_compute_ms_p99": float(np.percentile(c0, 99) * 1e3),
        "stage0_compute_ms_max": float(c0.max() * 1e3),
        "stage0_compute_cv": float(c0.std() / c0.mean()),
        "idle_share_per_stage": [float(1 - c.sum() / wall) for c in compute],
        "pipeline_idle_share": float(1 - sum(c.sum() for c in compute) / (pp * wall)),
        "timeline": [[(r[3] - start, r[4] - start) for r in recs] for recs in stages],
    }


def run_policy(llm: LLM, policy: str, budget: int, prompts, params) -> tuple[int, int, float]:
    from dataclasses import replace

    from stallfree.engine.scheduler import Scheduler

    eng = llm.engine
    cfg = eng.scheduler.config
    tunables = replace(cfg.tunables, token_budget=budget)
    eng.scheduler = Scheduler(replace(cfg, policy=policy, tunables=tunables), eng.block_manager)
    first = eng.executor._next_mb  # noqa: SLF001 - micro-batch ids delimit this policy's records
    t0 = time.monotonic()
    llm.generate(prompts, params, use_tqdm=False)
    return first, eng.executor._next_mb, time.monotonic() - t0  # noqa: SLF001


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results)), squeeze=False)
    for ax, (policy, r) in zip(axes[:, 0], results.items(), strict=True):
        for s, spans in enumerate(r["timeline"]):
            ax.broken_barh([(a, b - a) for a, b in spans], (s - 0.4, 0.8), color=f"C{s}")
        ax.set_yticks(range(len(r["timeline"])), [f"stage {s}" for s in range(len(r["timeline"]))])
        ax.set_title(
            f"{policy}: idle share {r['pipeline_idle_share']:.0%}, stage-0 CV {r['stage0_compute_cv']:.2f}"
        )
        ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from stallfree.bench.traces import load_trace, make_workload, prompt_token_ids
    from stallfree.engine.model.loader import load_model

    work = make_workload(
        load_trace(args.trace), args.num_requests, qps=1.0, scale=args.scale,
        max_model_len=args.max_model_len, seed=args.seed,
    )  # fmt: skip
    prompts = [prompt_token_ids(r.index, r.prompt_tokens, args.seed) for r in work.requests]
    params = [
        SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True) for r in work.requests
    ]
    loaded = load_model(None, dtype=torch.float32)
    llm = LLM(
        loaded_model=loaded, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, num_kv_blocks=1024,
        enable_prefix_caching=False,  # every policy runs the same prompts: none may reuse another's K/V
    )  # fmt: skip
    results, spans = {}, {}
    try:
        for policy in args.policies:
            spans[policy] = run_policy(llm, policy, args.token_budget, prompts, params)
        records = llm.engine.executor.stats()
    finally:
        llm.engine.shutdown()
    n_tokens = sum(r.prompt_tokens + r.output_tokens for r in work.requests)
    print(
        f"{'policy':10} {'mbs':>5} {'tok/mb':>7} {'CV':>6} {'p50 ms':>8} {'p99 ms':>8} {'idle':>6} {'wall s':>7}"
    )
    for policy, (first, last, wall) in spans.items():
        r = summarize(records, args.tp, args.pp, first, last)
        r["tokens_per_s"] = n_tokens / wall
        results[policy] = r
        print(
            f"{policy:10} {r['micro_batches']:5d} {r['tokens_per_micro_batch_mean']:7.1f} {r['stage0_compute_cv']:6.2f} "
            f"{r['stage0_compute_ms_p50']:8.1f} {r['stage0_compute_ms_p99']:8.1f} {r['pipeline_idle_share']:6.1%} "
            f"{r['wall_s']:7.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m experiments.pp_bubbles " + " ".join(argv or []),
        "tp": args.tp, "pp": args.pp, "token_budget": args.token_budget, "max_num_seqs": args.max_num_seqs,
        "workload": work.describe(), "device": "cpu, one torch thread per rank, gloo", "results": results,
    }  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"saved {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
