"""Where a CPU iteration with a prefill chunk riding along spends its time: ops by self time (torch.profiler).

    python -m experiments.llamacpp.hybrid_profile [--decodes 8] [--chunk 256] [--context 256]
        [--prompt 2048] [--iterations 3] [--threads 2] [--out FILE.json]

--decodes requests with --context-token prompts are brought to decode, then a --prompt-token request
arrives, so each of the next iterations is those decodes plus a --chunk-token chunk of it (token budget
decodes + chunk, the bundled model in the server's default bf16 + int4). Wall time of every iteration
is printed, then the profiled iterations' ops by self CPU time, in ms per iteration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from experiments.engine_bench import _engine, synthetic_ids
from stallfree.engine.model.loader import load_model
from stallfree.engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=8, help="requests in decode (default %(default)s)")
    ap.add_argument(
        "--chunk", type=int, default=256, help="prefill tokens per iteration (default %(default)s)"
    )
    ap.add_argument(
        "--context", type=int, default=256, help="prompt tokens of each decode (default %(default)s)"
    )
    ap.add_argument(
        "--prompt", type=int, default=2048, help="the arriving prompt's tokens (default %(default)s)"
    )
    ap.add_argument("--iterations", type=int, default=3, help="iterations timed, then as many profiled")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    a = ap.parse_args(argv)
    if a.prompt < 2 * a.iterations * a.chunk:
        ap.error("--prompt must last the timed and the profiled iterations: >= 2 x --iterations x --chunk")
    torch.set_num_threads(a.threads)
    loaded = load_model(
        None, dtype=getattr(torch, a.dtype), quantization=None if a.quantization == "none" else a.quantization
    )
    eng = _engine(loaded, a.decodes + a.chunk)
    sp = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for b in range(a.decodes):
        eng.add_request(f"d{b}", synthetic_ids(eng, a.context, salt=b + 1), sp)
    while any(not r.in_decode for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.add_request("long", synthetic_ids(eng, a.prompt, salt=999), SamplingParams(max_tokens=1))
    walls = []
    for _ in range(a.iterations):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.iterations):
            eng.step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    rows = [
        {"op": e.key, "ms_per_iteration": e.self_cpu_time_total / 1e3 / a.iterations,
         "share": e.self_cpu_time_total / total, "calls_per_iteration": e.count / a.iterations}
        for e in ops[:12]
    ]  # fmt: skip
    print(f"{loaded.name}, {a.dtype} + {a.quantization}, {a.threads} threads: {a.decodes} decodes (context "
          f"{a.context}) + a {a.chunk}-token chunk of a {a.prompt}-token prompt")  # fmt: skip
    print(
        f"iteration wall ms: {', '.join(f'{w * 1e3:.1f}' for w in walls)}  (median {statistics.median(walls) * 1e3:.1f})"
    )
    print(f"{'op (profiled, self CPU)':44s} {'ms/iter':>8s} {'share':>6s} {'calls':>6s}")
    for r in rows:
        print(f"{r['op']:44s} {r['ms_per_iteration']:8.2f} {r['share']:6.1%} {r['calls_per_iteration']:6.0f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps({"args": vars(a), "iteration_wall_s": walls, "ops": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
