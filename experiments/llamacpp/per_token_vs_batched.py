"""Decode ms per token at batch 1 / 8 / 32: `stallfree per-token` beside llama.cpp's own batched figure
(`llama-batched-bench`, built by scripts/peer-llamacpp), same GGUF, same threads, interleaved.

    python -m experiments.llamacpp.per_token_vs_batched [--batches 1,8,32] [--reps 3] [--threads 2]
        [--context 128] [--steps 12] [--out results/decode-vs-llamacpp-batched.json]

Per repetition: llama-batched-bench (-npp CONTEXT -ntg STEPS -npl BATCHES: each of B sequences has its
own CONTEXT-token prompt, then STEPS decode steps for all B at once; ms per token = 1000 / its tg speed),
then `python -m experiments.per_token --modes bfloat16:int4` (decode-only iterations of B requests after a CONTEXT-token
prompt; iteration wall time / B). Both include the LM head over the whole vocabulary. The JSON keeps every
repetition; the table prints medians with the min-max spread and stallfree / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def llamacpp(batches: str, threads: int, context: int, steps: int) -> dict[int, float]:
    """llama-batched-bench's ms per decoded token for each batch size."""
    out = subprocess.run(
        [str(ROOT / "scripts/peer-llamacpp"), "batched-bench", "--threads", str(threads), "--batches", batches,
         "--prompt", str(context), "--gen", str(steps)],  # fmt: skip
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {int(r["pl"]): 1000.0 / float(r["speed_tg"]) for r in rows}


def stallfree(batches: str, threads: int, context: int, steps: int) -> dict[int, float]:
    """`stallfree per-token`'s wall ms per token (bf16 + int4, the default CPU mode) for each batch size."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "experiments.per_token", "--modes", "bfloat16:int4", "--batches", batches,
             "--threads", str(threads), "--context", str(context), "--steps", str(steps), "--reps", "1",
             "--llamacpp-python", "", "--out", tmp],  # fmt: skip
            capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )  # fmt: skip
        res = json.loads((Path(tmp) / "per_token.json").read_text())
    return {int(r["batch"]): float(r["per_token_ms"]) for r in res["configs"].values()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default %(default)s)")
    ap.add_argument(
        "--context", type=int, default=128, help="prompt tokens per sequence (default %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=12, help="decode steps per repetition (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write every repetition as JSON here")
    args = ap.parse_args(argv)
    runs: dict[str, dict[int, list[float]]] = {"llama.cpp batched": {}, "stallfree": {}}
    loads = []
    for rep in range(args.reps):
        loads.append(os.getloadavg()[0])
        for name, fn in (("llama.cpp batched", llamacpp), ("stallfree", stallfree)):
            for b, ms in fn(args.batches, args.threads, args.context, args.steps).items():
                runs[name].setdefault(b, []).append(ms)
        print(
            f"repetition {rep + 1}/{args.reps} done (load average {loads[-1]:.1f})",
            file=sys.stderr,
            flush=True,
        )
    print(f"decode ms per token, {args.threads} threads, context {args.context}: median (min-max)")
    for b in sorted(runs["stallfree"]):
        ll, sf = runs["llama.cpp batched"].get(b, []), runs["stallfree"][b]
        cell = lambda v: f"{statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})"  # noqa: E731
        ratio = statistics.median(sf) / statistics.median(ll) if ll else float("nan")
        print(
            f"batch {b:>3}: llama.cpp {cell(ll) if ll else '-':>24}  stallfree {cell(sf):>24}  ratio {ratio:.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"what": "decode ms per token (wall), stallfree bf16+int4 vs llama-batched-bench", "threads": args.threads,
               "context": args.context, "steps": args.steps, "load_average_at_each_rep": loads,
               "runs_ms_per_token": {n: {str(b): v for b, v in d.items()} for n, d in runs.items()}}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
