"""A prefill chunk's attention, one layer: the cpu backend's paged kernel (every row on its own, the
row-invariant path) against SDPA over the gathered history with a bottom-right causal mask (the path it
replaced), SmolLM2 heads (9 query / 3 KV heads of 64), bf16.

    python -m experiments.llamacpp.chunk_attention [--chunk 256] [--context 1000] [--reps 3] [--threads 1]

Prints each repetition (kernel, SDPA alternating) and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from stallfree.engine.kernels import cpu_fused

H, KVH, HD, BS = 9, 3, 64, 16


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=256, help="query rows (default %(default)s)")
    ap.add_argument("--context", type=int, default=1000, help="keys of the last row (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    args = ap.parse_args(argv)
    if not 0 < args.chunk <= args.context:
        raise SystemExit("need 0 < --chunk <= --context")
    torch.set_num_threads(args.threads)
    n, ctx = args.chunk, args.context
    pages = -(-ctx // BS)
    kc = torch.randn(pages, BS, KVH, HD).bfloat16()
    vc = torch.randn_like(kc)
    q = torch.randn(n, H, HD).bfloat16()  # (n, H, hd)
    tables = torch.arange(pages, dtype=torch.int32).repeat(n, 1)  # (n, pages)
    lens = torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int32)  # row i sees ctx - n + 1 + i keys
    keys, vals = kc.view(-1, KVH, HD)[:ctx], vc.view(-1, KVH, HD)[:ctx]
    allowed = torch.arange(ctx)[None, :] <= (torch.arange(n) + ctx - n)[:, None]  # (n, ctx)

    def kernel():
        return cpu_fused.paged_decode_attention(q, kc, vc, tables, lens, HD**-0.5)

    def sdpa():
        qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, keys, vals))
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=HD**-0.5, enable_gqa=True)

    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    for f in (kernel, sdpa):
        f()  # warm
    for _ in range(args.reps):
        for name, f in (("kernel", kernel), ("sdpa", sdpa)):
            t = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t) * 1e3)
    for name, ts in times.items():
        print(
            f"{name:7s} ms per layer: median {statistics.median(ts):7.2f}  runs {', '.join(f'{t:.2f}' for t in ts)}"
        )


if __name__ == "__main__":
    main()
