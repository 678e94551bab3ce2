"""Iteration time along one long prompt's prefill: the plain token budget against chunks charged for their
context (`--chunk-context-scale`) at the same budget and at --charged-budget, the same engine, interleaved.

    python -m experiments.chunk_depth [--budget 192] [--scale 1331] [--charged-budget 224] [--prompt 2048]
        [--decodes 4] [--reps 2] [--threads 2] [--out results/chunk-depth]

--decodes requests are brought to decode first, so every iteration of the prefill carries them (as in a
server under load); then a --prompt-token request is prefilled, chunk by chunk, and each iteration's start,
chunk size and wall time are recorded. Modes take turns for --reps rounds (this box is shared and noisy).
Printed per mode: iterations, median / max iteration ms, and the prefill's total time (its TTFT alone);
saved: chunk_depth.json and chunk_depth.png (iteration ms against the chunk's start) in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from experiments.engine_bench import _engine, synthetic_ids
from stallfree.bench.report import pyplot, table
from stallfree.engine.model.loader import load_model
from stallfree.engine.sampling_params import SamplingParams


def prefill_iterations(
    loaded, budget: int, scale: int | None, prompt: int, decodes: int, salt: int
) -> list[dict]:
    """(start, tokens, wall ms) of each iteration that prefills a `prompt`-token request beside `decodes`
    running decodes, under `budget` (chunks charged with context scale `scale`, or plainly)."""
    eng = _engine(loaded, budget)
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, chunk_context_scale=scale)
    keep = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for b in range(decodes):
        eng.add_request(f"d{b}", synthetic_ids(eng, 300, salt=salt + b + 1), keep)
    while any(not r.in_decode for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.add_request("long", synthetic_ids(eng, prompt, salt=salt), SamplingParams(max_tokens=1))
    rows = []
    while (req := eng.scheduler.get("long")) is not None and not req.in_decode:
        start = req.num_computed_tokens
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        after = eng.scheduler.get("long")
        done = after.num_computed_tokens if after is not None and not after.in_decode else prompt
        rows.append({"start": start, "tokens": done - start, "ms": wall * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=192, help="token budget (default %(default)s)")
    ap.add_argument("--scale", type=int, default=1331, help="the charged mode's context scale C "
                    "(stallfree tune --chunk-context-scale auto; default %(default)s)")  # fmt: skip
    ap.add_argument("--charged-budget", type=int, default=224, help="also the charged mode at this budget: "
                    "what tune picks with the charge (default %(default)s)")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default %(default)s)")
    ap.add_argument("--decodes", type=int, default=4, help="running decodes (default %(default)s)")
    ap.add_argument(
        "--reps", type=int, default=2, help="rounds, the modes taking turns (default %(default)s)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    ap.add_argument("--out", default="results/chunk-depth")
    a = ap.parse_args(argv)
    if a.budget <= a.decodes or a.scale < 1 or a.prompt < 1:
        ap.error("need --budget > --decodes, --scale >= 1 and --prompt >= 1")
    torch.set_num_threads(a.threads)
    loaded = load_model(None, dtype=torch.bfloat16, quantization="int4")
    modes = {f"plain@{a.budget}": (a.budget, None), f"charged@{a.budget} C={a.scale}": (a.budget, a.scale)}
    if a.charged_budget and a.charged_budget != a.budget:
        modes[f"charged@{a.charged_budget} C={a.scale}"] = (a.charged_budget, a.scale)
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for rep in range(a.reps):
        for name, (budget, scale) in modes.items():
            runs[name].append(prefill_iterations(loaded, budget, scale, a.prompt, a.decodes, salt=1000 * rep))
            print(f"round {rep + 1}/{a.reps} {name}: {len(runs[name][-1])} iterations", flush=True)
    summary = []
    for name, reps in runs.items():
        its = [r["ms"] for rep in reps for r in rep]
        summary.append({
            "mode": name,
            "iterations": statistics.median(len(rep) for rep in reps),
            "median_ms": statistics.median(its),
            "max_ms": max(its),
            "prefill_s": statistics.median(sum(r["ms"] for r in rep) / 1e3 for rep in reps),
        })  # fmt: skip
    print(
        table(
            ["mode", "iterations", "median ms", "max ms", "prefill s"],
            [
                [
                    s["mode"],
                    s["iterations"],
                    f"{s['median_ms']:.0f}",
                    f"{s['max_ms']:.0f}",
                    f"{s['prefill_s']:.2f}",
                ]
                for s in summary
            ],  # fmt: skip
            title=f"a {a.prompt}-token prompt beside {a.decodes} decodes, {a.threads} threads, {a.reps} rounds",
        )
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_depth.json").write_text(
        json.dumps({"args": vars(a), "summary": summary, "runs": runs}, indent=2)
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, reps), color in zip(runs.items(), ("tab:red", "tab:blue", "tab:green"), strict=False):
        for i, rep in enumerate(reps):
            ax.plot([r["start"] for r in rep], [r["ms"] for r in rep], marker=".", color=color, alpha=0.7,
                    label=name if i == 0 else None)  # fmt: skip
    ax.set_xlabel("chunk start (tokens of the prompt already computed)")
    ax.set_ylabel("iteration ms")
    ax.set_title(f"prefill of {a.prompt} tokens beside {a.decodes} decodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "chunk_depth.png", dpi=100)
    plt.close(fig)
    print(f"saved {out / 'chunk_depth.json'} and {out / 'chunk_depth.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
