"""Where a CPU iteration's linear-layer time goes: the one row-invariant GEMM (cpu_linear.PackedLinear)
against the two paths it replaced (torch's int4 weight-only kernel for <= 6 rows, oneDNN's bf16 matmul on
the dequantized weights above), on the SmolLM2-135M shapes (all 30 layers' qkv, o, gate_up, down; the
int8 LM head separately), for a range of row counts.

    python -m experiments.llamacpp.gemm_paths [--rows 1,8,32,128,512] [--reps 5] [--threads 2]
        [--out docs/figures/cpu-gemm-paths.json]

Repetitions are interleaved (old, new, old, new, ...) so a busy machine slows both alike; the JSON keeps
every repetition, and the table prints medians with the min-max spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from stallfree.engine.model.cpu_linear import PackedLinear, quantize_int4

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)
HEAD = (49152, 576)


class OldInt4:
    """The replaced layer: weight-only int4 kernel for few rows, oneDNN bf16 on dequantized weights else."""

    def __init__(self, w: torch.Tensor) -> None:
        codes, scale, zero = quantize_int4(w)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        self.sz = sz
        s, z = sz.float().transpose(0, 1).unbind(-1)
        wd = ((codes.float().view(*s.shape, -1) - 8) * s[..., None] + z[..., None]).view_as(w).bfloat16()
        self.bf16 = torch.ops.mkldnn._reorder_linear_weight(wd, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= 6:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, 32, self.sz)
        return torch.ops.mkldnn._linear_pointwise(x, self.bf16, None, "none", [], "")


def one_layer_ms(layers, rows: int) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {s[1] for s in SHAPES}}
    t = time.perf_counter()
    for lin, (_, k) in zip(layers, SHAPES, strict=True):
        lin(xs[k])
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default="1,8,32,128,512", help="comma-separated row counts (default %(default)s)"
    )
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    paths = {"old (int4 kernel <= 6 rows, oneDNN bf16 above)": [OldInt4(w) for w in ws],
             "new (one int4 GEMM, row-invariant)": [PackedLinear(w, None, "int4") for w in ws]}  # fmt: skip
    rows = [int(r) for r in args.rows.split(",")]
    runs: dict[str, dict[int, list[float]]] = {p: {r: [] for r in rows} for p in paths}
    for r in rows:
        for layers in paths.values():
            one_layer_ms(layers, r)  # warm: oneDNN creates its primitive per shape on first use
        for _ in range(args.reps):
            for name, layers in paths.items():
                runs[name][r].append(LAYERS * one_layer_ms(layers, r))
    print(f"{'rows':>5}  " + "  ".join(f"{p[:34]:>34}" for p in paths) + "  new/old")
    for r in rows:
        med = [statistics.median(runs[p][r]) for p in paths]
        cells = [
            f"{m:9.1f} ms ({min(runs[p][r]):.1f}-{max(runs[p][r]):.1f})"
            for m, p in zip(med, paths, strict=True)
        ]
        print(f"{r:>5}  " + "  ".join(f"{c:>34}" for c in cells) + f"  {med[1] / med[0]:6.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {"what": "linear layers of 30 SmolLM2-135M layers, ms per iteration", "threads": args.threads,
                   "runs_ms": {p: {str(r): v for r, v in d.items()} for p, d in runs.items()}}  # fmt: skip
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
