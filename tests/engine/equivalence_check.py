"""Records what the engine computes on fixed mixed batches, and checks a later tree computes exactly that.

For refactors of the runner and the attention backends: run `record` on the old tree, `check` on the new one.
Each scenario drives the engine step by step over a fixed set of prompts (decodes riding with prefill
chunks, several token budgets, a second wave whose prompts hit the prefix cache) and keeps, per iteration,
the raw logits of every sampled row (copied off the model's `compute_logits`) and the greedy token ids.
`check` asserts both are bit-identical (torch.equal), scenario by scenario.

Scenarios: the torch and cpu backends on the bundled SmolLM2-135M (float32, and the CPU default
bfloat16 + int4), and the triton backend (the CUDA runner's path) on a tiny random-weight model, which runs
on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set here when there is no GPU).

    python tests/engine/equivalence_check.py record /tmp/i28-baseline.pt
    python tests/engine/equivalence_check.py check /tmp/i28-baseline.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # "bundled" or "tiny" (random weights)
    backend: str
    dtype: str
    quantization: str
    budgets: tuple[int, ...]


SCENARIOS = (
    Scenario("torch-fp32", "bundled", "torch", "float32", "none", (16, 48, 512)),
    Scenario("cpu-fp32", "bundled", "cpu", "float32", "none", (16, 48, 512)),
    Scenario("cpu-bf16-int4", "bundled", "cpu", "bfloat16", "int4", (16, 48, 512)),
    Scenario("torch-bf16-int4", "bundled", "torch", "bfloat16", "int4", (48,)),
    Scenario("triton-tiny-fp32", "tiny", "triton", "float32", "none", (16, 48)),
    Scenario("torch-tiny-fp32", "tiny", "torch", "float32", "none", (16,)),  # seconds: the checker's own test
)


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first wave of mixed lengths, and a second wave sharing the first's prefixes (prefix-cache hits)."""
    lengths = [37, 5, 90, 18, 64]
    first = [[(97 * i + 31 * k) % (vocab - 3) + 3 for i in range(n)] for k, n in enumerate(lengths)]
    second = [first[2][:80] + [7, 8, 9], first[4][:48] + [11], first[0] + [5, 6]]
    return first, second


def _engine(sc: Scenario, budget: int, loaded):
    from stallfree.engine import LLM

    return LLM(
        loaded_model=loaded, attention_backend=sc.backend, token_budget=budget, dtype=sc.dtype,
        quantization=sc.quantization, device="cpu", num_kv_blocks=128, max_num_seqs=8,
        enable_prefix_caching=True, seed=0,
    ).engine  # fmt: skip


def _load(sc: Scenario):
    from stallfree.engine.model.loader import load_model

    if sc.model == "bundled":
        return load_model(None, dtype=getattr(torch, sc.dtype), quantization=sc.quantization)
    from stallfree.engine.model.dummy import build_dummy_model, synthetic_tokenizer
    from stallfree.engine.model.loader import LoadedModel

    sys.path.insert(0, os.path.dirname(__file__))
    from cuda_helpers import TINY

    model = build_dummy_model(TINY, getattr(torch, sc.dtype), "cpu", seed=0)
    return LoadedModel(model, synthetic_tokenizer(TINY.vocab_size), TINY, "dummy-tiny")


def _drive(engine, waves: tuple[list[list[int]], ...], max_tokens: int) -> list[tuple[torch.Tensor, list]]:
    """Run the waves one after the other; per iteration: (logits of the sampled rows, sampled tokens)."""
    from stallfree.engine import SamplingParams

    model = engine.loaded.model
    seen: list[torch.Tensor] = []
    orig = type(model).compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits = orig(model, hidden)
        seen.append(logits.detach().to("cpu", copy=True))
        return logits

    model.compute_logits = spy  # the instance attribute shadows the method for this engine only
    steps = []
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        n = 0
        for wave in waves:
            for p in wave:
                engine.add_request(f"r{n}", p, sp)
                n += 1
            while engine.has_unfinished_requests():
                outs = engine.step()
                toks = sorted((o.request_id, list(o.token_ids)) for o in outs)
                logits = torch.cat(seen) if seen else torch.empty(0)
                seen.clear()
                steps.append((logits, toks))
    finally:
        del model.compute_logits
    return steps


def run_all(names: list[str] | None = None, max_tokens: int = 5) -> dict[str, list]:
    results: dict[str, list] = {}
    for sc in SCENARIOS:
        if names and sc.name not in names:
            continue
        loaded = _load(sc)
        waves = _prompts(loaded.config.vocab_size)
        for budget in sc.budgets:
            engine = _engine(sc, budget, loaded)
            results[f"{sc.name}/budget{budget}"] = _drive(engine, waves, max_tokens)
            del engine
    return results


def compare(base: dict[str, list], got: dict[str, list]) -> list[str]:
    """Differences between two recordings (empty when they are bit-identical)."""
    problems = []
    for key, steps in base.items():
        if key not in got:
            problems.append(f"{key}: missing from the new run")
            continue
        new = got[key]
        if len(new) != len(steps):
            problems.append(f"{key}: {len(new)} iterations, baseline {len(steps)}")
            continue
        for i, ((la, ta), (lb, tb)) in enumerate(zip(steps, new, strict=True)):
            if ta != tb:
                problems.append(f"{key} step {i}: tokens {tb} != baseline {ta}")
                break
            if la.shape != lb.shape or la.dtype != lb.dtype or not torch.equal(la, lb):
                diff = (la.float() - lb.float()).abs().max().item() if la.shape == lb.shape else "shape"
                problems.append(f"{key} step {i}: logits differ (max abs diff {diff})")
                break
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("record", "check"), help="record a baseline, or check against one")
    ap.add_argument("path", help="the baseline file (keep it out of git, e.g. under /tmp)")
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    got = run_all(args.only)
    if args.mode == "record":
        torch.save(got, args.path)
        print(f"recorded {len(got)} runs, {sum(len(s) for s in got.values())} iterations -> {args.path}")
        return 0
    base = torch.load(args.path, weights_only=False)
    if args.only:
        base = {k: v for k, v in base.items() if k.split("/")[0] in args.only}
    problems = compare(base, got)
    for p in problems:
        print("DIFF", p)
    n_steps = sum(len(s) for s in base.values())
    print(f"{len(base)} runs, {n_steps} iterations: {'bit-identical' if not problems else 'DIFFERENT'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
