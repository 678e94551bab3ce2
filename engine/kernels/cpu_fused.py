"""Fused CPU kernels for a Llama layer, in C++ (cpu_kernels.cpp), built on this machine at first use.

The same four operations as the CUDA path's `stallfree.engine.kernels.fused` (residual-add + RMSNorm,
SiLU-and-mul, RoPE in place, KV-cache store), with the same signatures and the same `*_ref` semantics, plus
`paged_decode_attention`: each decode's attention read straight from the paged cache (no page gather, no
padding between decodes of different lengths). Together they turn a layer of a decode iteration from ~40
small torch ops into eight calls (docs/engine.md has the measurement).

Building: torch's JIT extension loader compiles the source once per machine and source version (about
20 s with g++ and ninja) into `$STALLFREE_CACHE/cpu-kernels` (default ~/.cache/stallfree); later processes
load the built library in well under a second. `load()` raises when it cannot build or load them;
`available()` says whether they are usable (and logs why not, once), and the engine then keeps the
plain-torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch
from torch import Tensor

from stallfree.engine.kernels.fused import (  # noqa: F401 - the references these kernels are held to
    add_rmsnorm_ref,
    rope_ref,
    silu_and_mul_ref,
    store_kv_ref,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -fno-math-errno lets the compiler call the vector exp in SiLU; -march=native: see _cpu_model.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _build_dir(tag: str) -> Path:
    cache = Path(os.environ.get("STALLFREE_CACHE", Path.home() / ".cache/stallfree"))
    return cache / "cpu-kernels" / tag


def _cpu_model() -> str:
    """The CPU's model name: built with -march=native, a library only suits the CPU it was built for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def load() -> object:
    """Build (first time) and load the kernels; returns torch.ops.stallfree_cpu. Raises on failure."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, only when the kernels are wanted

    code = SOURCE.read_bytes()
    # torch's own location is part of the key: the build's include paths and ninja file point into it.
    salt = repr(CFLAGS) + _cpu_model() + torch.__version__ + str(Path(torch.__file__).parent)
    key = hashlib.sha256(code + salt.encode()).hexdigest()[:16]
    build = _build_dir(key)
    build.mkdir(parents=True, exist_ok=True)
    if not (build / f"stallfree_cpu_{key}.so").exists():
        logger.info("building the CPU kernels (once per machine, ~20 s) in %s", build)
    # NOTE: compile a copy kept in the build folder, not the checkout's file: the ninja file records the source's
    # path, so two checkouts (or venvs) of the same code sharing the cache would otherwise rebuild each other's
    # library on every load.
    source = build / SOURCE.name
    if not source.exists() or source.read_bytes() != code:
        tmp = source.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(code)
        tmp.replace(source)
    cpp_extension.load(
        name=f"stallfree_cpu_{key}",
        sources=[str(source)],
        build_directory=str(build),
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.stallfree_cpu


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here; logs the reason once when they do not."""
    try:
        load()
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: all mean "not here"
        logger.warning(
            "the CPU kernels are not available (%s: %s); using plain torch ops", type(e).__name__, e
        )
        return False
    return True


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(weight * normalise(x + residual), x + residual), both (T, C) in x.dtype; see fused.add_rmsnorm.

    Without a residual the second tensor is a copy of x."""
    return load().add_rmsnorm(x, residual, weight.to(x.dtype), eps)


def silu_and_mul(x: Tensor) -> Tensor:
    """x (T, 2I) = gate | up -> silu(gate) * up (T, I), computed in fp32, rounded once."""
    return load().silu_and_mul(x)


def rope_(q: Tensor, k: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor) -> None:
    """Rotate q (T, nh, hd) and k (T, nkv, hd) in place (strided views of a fused qkv are fine); caches
    (max_pos, hd/2) float32; positions (T,) int64 and checked against the tables."""
    load().rope_(q, k, positions, cos_cache, sin_cache)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k and v (T, nkv, hd) into the flat caches (num_slots, nkv, hd) at slot_mapping (T,) int64;
    negative slots are skipped. Slots are checked against the cache."""
    load().store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Attention of D decodes over their paged history: q (D, H, hd) -> (D, H, hd) in q.dtype.

    k_cache / v_cache (num_blocks, block_size, nkv, hd); block_tables (D, pages) int32, each decode's
    blocks in order (padding after its last page is never read); seq_lens (D,) int32, the history length
    including the token being decoded (already stored). Query head h reads KV head h // (H // nkv).
    Computed in fp32 with an exact softmax (max subtracted), one rounding per output.
    """
    return load().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Reference for `paged_decode_attention`: one decode at a time in fp32 torch ops."""
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for d in range(q.shape[0]):
        n = int(seq_lens[d])
        pages = block_tables[d, : -(-n // bs)].long()
        keys = k_cache[pages].reshape(-1, nkv, q.shape[2])[:n].float()  # (n, nkv, hd)
        vals = v_cache[pages].reshape(-1, nkv, q.shape[2])[:n].float()
        g = q.shape[1] // nkv
        qq = q[d].float().view(nkv, g, -1)  # (nkv, g, hd)
        scores = torch.einsum("kgd,nkd->kgn", qq, keys) * scale
        out[d] = torch.einsum("kgn,nkd->kgd", scores.softmax(-1), vals).reshape(q.shape[1], -1).to(q.dtype)
    return out


def packed_linear(
    x: Tensor, kind: int, weight: Tensor, scale: Tensor, minv: Tensor, bias: Tensor | None, out_features: int
) -> Tensor:
    """x (T, K) -> (T, N) in x.dtype through the one GEMM for every row count (see cpu_linear.PackedLinear,
    which prepares the weights). Each output is one fixed float32 sequence of operations, whatever T."""
    return load().packed_linear(x, kind, weight, scale, minv, bias, out_features)
