"""`python -m experiments.sampler_bench`: what penalties and logit_bias cost the sampler, side by side in one run.

One batch of `--batch` rows over a `--vocab`-wide vocabulary is sampled `--reps` times per case, each
case the same logits: no row with penalties (the baseline), one row, a quarter of the rows, every row (with
presence, frequency and repetition penalties and a 4-token logit_bias). Greedy and random (temperature 0.8)
batches, on the CPU sampler and, when CUDA is there, the GPU sampler. Each row's history grows by one token
per call, as in a decode. The cases run interleaved, call by call, so load drift hits them alike. Prints the median (and P10-P90) milliseconds per call and the ratio to the
baseline; saves sampler.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from stallfree.bench.report import table
from stallfree.engine.gpu_sampler import GpuSampler
from stallfree.engine.sampler import Sampler, SampleRequest
from stallfree.engine.sampling_params import SamplingParams


def _params(penalised: bool, temperature: float, max_tokens: int) -> SamplingParams:
    if not penalised:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias={1: 2.0, 2: -3.0, 3: 1.0, 4: -100.0})  # fmt: skip


class Case:
    """One (device, temperature, penalised rows) case: its own sampler and requests, the same logits."""

    def __init__(
        self, device: torch.device, logits: torch.Tensor, n_pen: int, temperature: float, steps: int
    ):
        cls = GpuSampler if device.type == "cuda" else Sampler
        self.name = cls.__name__
        self.device, self.logits, self.n_pen, self.temperature = device, logits, n_pen, temperature
        self.sampler = cls(frozenset(), seed=0, device=device)
        self.params = [_params(i < n_pen, temperature, steps + 8) for i in range(logits.shape[0])]
        self.step = 0
        self.ms: list[float] = []

    def call(self, timed: bool) -> None:
        prompt = tuple(range(5, 260)) if self.step == 0 else ()
        reqs = [SampleRequest(f"r{i}", p, self.step, prompt) for i, p in enumerate(self.params)]
        x = self.logits.clone()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.sampler.sample(x, reqs)  # returns host values: its own synchronisation
        if timed:
            self.ms.append((time.perf_counter() - t0) * 1e3)
        self.step += 1


def run(batch: int, vocab: int, reps: int, devices: list[str]) -> list[dict]:
    """Every case, interleaved call by call (load drift on a shared machine hits them alike)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen)
    cases = [
        Case(torch.device(dev), logits.to(dev), n_pen, temperature, reps + 3)
        for dev in devices
        for temperature in (0.0, 0.8)
        for n_pen in sorted({0, 1, max(1, batch // 4), batch})
    ]
    for rep in range(reps + 3):
        for c in cases:
            c.call(timed=rep >= 3)  # 3 warm-up calls
    rows, base = [], {}
    for c in cases:
        med = statistics.median(c.ms)
        key = (str(c.device), c.temperature)
        base.setdefault(key, med)  # n_pen 0 comes first
        q = statistics.quantiles(c.ms, n=10) if len(c.ms) > 1 else [med] * 9
        rows.append({"device": str(c.device), "sampler": c.name, "temperature": c.temperature,
                     "batch": batch, "vocab": vocab, "penalised_rows": c.n_pen, "median_ms": med,
                     "p10_ms": q[0], "p90_ms": q[-1], "ratio": med / base[key]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.sampler_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batch", type=int, default=32, help="rows per sample call (sampled requests)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's by default)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per case")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default="results/sampler", help="folder for sampler.json")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.vocab < 300 or args.reps < 1:
        ap.error("--batch and --reps must be >= 1 and --vocab >= 300")
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = run(args.batch, args.vocab, args.reps, devices)
    cols = ["device", "temperature", "penalised_rows", "median_ms", "p10_ms", "p90_ms", "ratio"]
    print(table(cols, [[r[c] if not isinstance(r[c], float) else f"{r[c]:.3f}" for c in cols] for r in rows]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"saved {out / 'sampler.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
