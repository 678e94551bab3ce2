"""`stallfree per-token`: decode ms per token of each CPU mode beside llama.cpp's, in one sitting.

Per repetition, in turn: llama.cpp (its own Python package, in the virtual environment that
`scripts/peer-llamacpp install` builds) evaluates one token at a time after a --context-token prompt on the
same GGUF with the same thread count; then stallfree runs decode-only iterations at each --batches size in
each --modes (dtype:quantization) with a --context-token prompt per request. Wall time of each iteration
(both sides include the LM head over the whole vocabulary), medians over repetitions. The box is shared,
so the configurations alternate and each repetition sees the same background. Results: per_token.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

LLAMACPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, threads, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
def run(salt, n):
    prompt = [(1009 * (i + 1) + 7919 * salt) % 48000 + 100 for i in range(context)]  # no shared prefix
    t0, c0 = time.perf_counter(), time.process_time()
    llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias={2: -100.0})
    return time.perf_counter() - t0, time.process_time() - c0
run(0, 2)
wall, cpu = [], []
for k in range(3):  # (n + 1 tokens) - (1 token): n decode steps without the prefill
    (w1, c1), (w0, c0) = run(2 * k + 1, steps + 1), run(2 * k + 2, 1)
    wall.append((w1 - w0) / steps)
    cpu.append((c1 - c0) / steps)
print(json.dumps({"wall": wall, "cpu": cpu}))
"""


def llamacpp_times(python: str, model: str, threads: int, context: int, steps: int) -> dict[str, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [python, "-c", LLAMACPP_SCRIPT, model, str(threads), str(context), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stallfree per-token", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", default="float32:none,bfloat16:none,bfloat16:int4",
                    help="comma list of dtype:quantization modes of stallfree to time")  # fmt: skip
    ap.add_argument("--batches", default="1,32", help="comma list of decode batch sizes")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU threads for both sides (default: every core this process may use)")  # fmt: skip
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decodes")
    ap.add_argument(
        "--steps", type=int, default=16, help="decode iterations per configuration and repetition"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions; configurations alternate within each")
    cache = Path(os.environ.get("STALLFREE_CACHE", Path.home() / ".cache/stallfree"))
    ap.add_argument(
        "--llamacpp-python",
        default=os.path.join(
            os.environ.get("STALLFREE_LLAMACPP_VENV", str(cache / "llamacpp-venv")), "bin/python"
        ),
        help="python of scripts/peer-llamacpp's environment ('' to skip llama.cpp)",
    )
    ap.add_argument("--out", default="results/per-token", help="folder for per_token.json")
    args = ap.parse_args(argv)

    import torch

    from experiments.engine_bench import _engine, decode_iterations
    from stallfree.engine.model.loader import load_model
    from stallfree.engine.paths import default_model_path

    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    loaded = {}
    for m in modes:
        dtype, q = m.split(":")
        loaded[m] = load_model(None, dtype=getattr(torch, dtype), quantization=q)
    times: dict[str, list[float]] = {}  # wall seconds per iteration (llama.cpp: per token)
    cpu: dict[str, list[float]] = {}  # CPU seconds: the engine thread's, llama.cpp's whole process
    for rep in range(args.reps):
        if args.llamacpp_python:
            t = llamacpp_times(
                args.llamacpp_python, str(default_model_path()), args.threads, args.context, args.steps * 2
            )  # three per-token estimates, each from a 2 x steps-token completion minus a 1-token one
            times.setdefault("llamacpp@1", []).extend(t["wall"])
            cpu.setdefault("llamacpp@1", []).extend(t["cpu"])
        for m in modes:
            for b in batches:
                st = decode_iterations(_engine(loaded[m], 4096), b, args.context, args.steps)
                times.setdefault(f"{m}@{b}", []).extend(s.time_total for s, _ in st)
                cpu.setdefault(f"{m}@{b}", []).extend(c for _, c in st)
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    result: dict = {"threads": args.threads, "context": args.context, "configs": {}}
    for key, ts in times.items():
        b = int(key.rsplit("@", 1)[1])
        med, med_cpu = statistics.median(ts), statistics.median(cpu[key])
        result["configs"][key] = {
            "batch": b,
            "iteration_ms": med * 1e3,
            "per_token_ms": med * 1e3 / b,
            "per_token_cpu_ms": med_cpu * 1e3 / b,
        }
    peer = result["configs"].get("llamacpp@1")
    print(f"decode, {args.threads} thread(s), context {args.context}: medians, ms per token")
    print("NOTE: CPU time counts the work itself when --threads 1; wall time includes whatever else ran")
    for key, r in result["configs"].items():
        vs = ""
        if peer and r["batch"] == 1:
            vs = (
                f"  ({r['per_token_ms'] / peer['per_token_ms']:.2f}x wall, "
                f"{r['per_token_cpu_ms'] / peer['per_token_cpu_ms']:.2f}x CPU of llama.cpp)"
            )
        print(f"{key:24s} wall {r['per_token_ms']:8.2f}  CPU {r['per_token_cpu_ms']:8.2f}{vs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["samples_s"] = {"wall": times, "cpu": cpu}
    (out / "per_token.json").write_text(json.dumps(result, indent=2))
    print(f"saved {out / 'per_token.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
