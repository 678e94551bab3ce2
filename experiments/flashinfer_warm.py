"""Compile (JIT) the FlashInfer kernels the engine plans, ahead of the first request: one kind per call.

FlashInfer builds one module per (kind, dtype, head_dim) with nvcc on first use: about 2.5 minutes each on
16 cores (../shared/GPU.md). scripts/gpu-check starts one of these per kind in the background, in parallel,
while the Triton path is tested; a Dockerfile can run them at build time. The compiled modules land in
FlashInfer's cache ($FLASHINFER_WORKSPACE_BASE), where the engine finds them.

    python -m experiments.flashinfer_warm --kind decode --dtype bfloat16 --head-dim 128
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.flashinfer_warm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kind", choices=["decode", "prefill"], required=True, help="which wrapper to compile")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415

    from stallfree.engine.attention import KVCache  # noqa: PLC0415
    from stallfree.engine.cuda_attention import DeviceBatch, FlashInferAttention  # noqa: PLC0415
    from stallfree.engine.cuda_batch import HostBatch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("flashinfer_warm: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype, dev, bs = getattr(torch, args.dtype), torch.device("cuda"), args.block_size
    cache = KVCache(1, 8, bs, args.num_kv_heads, args.head_dim, dtype, dev)
    attn = FlashInferAttention(cache, args.num_heads, args.num_kv_heads, args.head_dim)
    i64 = np.int64
    n = 1 if args.kind == "decode" else bs + 3
    table = np.arange(4, dtype=i64)[None, :]
    empty = np.zeros(0, dtype=i64)
    hb = HostBatch(
        input_ids=np.zeros(n, dtype=i64),
        positions=np.arange(n, dtype=i64),
        slot_mapping=np.arange(n, dtype=i64),
        num_decodes=1 if args.kind == "decode" else 0,
        decode_lens=np.array([1], dtype=i64) if args.kind == "decode" else empty,
        decode_tables=table if args.kind == "decode" else np.zeros((0, 1), dtype=i64),
        prefill_q_starts=empty if args.kind == "decode" else np.array([0], dtype=i64),
        prefill_q_lens=empty if args.kind == "decode" else np.array([n], dtype=i64),
        prefill_ctx_lens=empty if args.kind == "decode" else np.array([0], dtype=i64),
        prefill_tables=np.zeros((0, 1), dtype=i64) if args.kind == "decode" else table,
        prefill_hist_slots=empty if args.kind == "decode" else np.arange(n, dtype=i64),
        prefill_hist_offsets=np.array([0], dtype=i64)
        if args.kind == "decode"
        else np.array([0, n], dtype=i64),
        sample_rows=np.array([n - 1], dtype=i64),
    )

    def dev_(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(dev)

    batch = DeviceBatch(
        hb, dev_(hb.slot_mapping), dev_(hb.decode_lens), dev_(hb.decode_tables), 1, dev_(hb.prefill_q_starts),
        dev_(hb.prefill_q_lens), dev_(hb.prefill_ctx_lens), dev_(hb.prefill_tables), dev_(hb.prefill_hist_slots),
    )  # fmt: skip
    attend = attn.bind(batch)
    q = torch.randn(n, args.num_heads, args.head_dim, dtype=dtype, device=dev)
    k = torch.randn(n, args.num_kv_heads, args.head_dim, dtype=dtype, device=dev)
    out = attend(0, q, k, k.clone())
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(out).all())
    print(
        f"flashinfer {args.kind} {args.dtype} head_dim {args.head_dim}: ready in {time.perf_counter() - t0:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
