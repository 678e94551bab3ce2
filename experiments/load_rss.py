"""`python -m experiments.load_rss`: peak host RSS while the safetensors loader streams a checkpoint of a named shape.

The checkpoint is written here, with the real per-tensor shapes of the shape (e.g. llama3-8b: 291 tensors,
16 GB in bf16, in 5 GB shards as Hugging Face shards it) but as sparse files: each shard is a safetensors
header followed by a hole, so it costs a few KB of disk while every read through safe_open's memory map
and every dtype conversion really happens (on zeros). A fresh subprocess then imports everything, resets
its peak RSS, records its RSS as the baseline and runs the loader; the figure is VmHWM - baseline.

Sinks (what receives each parameter):
  drop   the loader's real path (stallfree.engine.model.safetensors_stream.stream_checkpoint): every
         parameter is allocated on the host in the target dtype, filled from its checkpoint tensors, and
         dropped as soon as it is whole. On a GPU the destination is device memory, so this is the GPU
         path's host overhead plus one parameter on the host (the largest: the 1 GB embedding of an 8B).
  model  load_streamed into a model on the host, which then holds the whole model: the figure is the
         model's bytes plus the loader's overhead (use a small shape).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SHARD_BYTES = 5 * 10**9  # what save_pretrained's default max_shard_size ("5GB") gives
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ITEM = {"BF16": 2, "F16": 2, "F32": 4}


def checkpoint_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """HF checkpoint key -> shape for a LlamaConfig (q/k/v and gate/up unfused, as checkpoints store them)."""
    c, hd = config.hidden_size, config.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, c)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (c,)
        for name, rows in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, c)
            if config.qkv_bias:
                out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "self_attn.o_proj.weight"] = (c, config.q_size)
        if config.o_proj_bias:
            out[p + "self_attn.o_proj.bias"] = (c,)
        out[p + "post_attention_layernorm.weight"] = (c,)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (config.intermediate_size, c)
        out[p + "mlp.down_proj.weight"] = (c, config.intermediate_size)
    out["model.norm.weight"] = (c,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, c)
    return out


def _write_sparse_shard(path: Path, tensors: dict[str, tuple[int, ...]], st_dtype: str) -> int:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = math.prod(shape) * _ITEM[st_dtype]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # a hole: reads give zeros, the disk holds nothing
    return offset


def write_sparse_checkpoint(
    folder: Path, shape: str, dtype: str = "bfloat16", layers: int | None = None
) -> dict[str, Any]:
    """A Hugging Face folder (config.json + sparse safetensors shards) of the named dummy shape; `layers`
    keeps only that many decoder layers (every tensor keeps its real size)."""
    from stallfree.engine.model.dummy import dummy_config  # noqa: PLC0415 - imports torch

    config = dummy_config(shape)
    if layers is not None:
        config = replace(config, num_layers=layers)
    folder.mkdir(parents=True, exist_ok=True)
    st_dtype = _ST_DTYPES[dtype]
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shp in checkpoint_tensors(config).items():
        n = math.prod(shp) * _ITEM[st_dtype]
        if size and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shp
        size += n
    total = 0
    for i, tensors in enumerate(shards):
        total += _write_sparse_shard(
            folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", tensors, st_dtype
        )
    hf = {
        "architectures": ["Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": dtype,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    return {"shards": len(shards), "tensors": sum(len(s) for s in shards), "checkpoint_bytes": total}


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _child(folder: Path, dtype: str, sink_kind: str) -> dict[str, Any]:
    """Runs in the measured subprocess: baseline after imports, then the load, then the peak."""
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from stallfree.engine.model.hf_loader import _read_json, config_from_hf  # noqa: PLC0415
    from stallfree.engine.model.llama import LlamaForCausalLM  # noqa: PLC0415
    from stallfree.engine.model.safetensors_stream import load_streamed, stream_checkpoint  # noqa: PLC0415

    torch_dtype = getattr(torch, dtype)
    config = config_from_hf(_read_json(folder / "config.json"))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    largest = max(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=torch_dtype).element_size()
    gc.collect()
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    baseline = _status_kb("VmRSS")
    start = time.perf_counter()
    params = 0

    class DropSink:
        def allocate(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.empty(shape, dtype=torch_dtype)

        def complete(self, name: str, tensor: torch.Tensor) -> None:
            nonlocal params
            params += 1

    if sink_kind == "drop":
        nbytes = stream_checkpoint(config, folder, shapes, DropSink())
    else:
        model = load_streamed(config, folder, torch_dtype, "cpu")
        params = len(list(model.parameters()))
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    mib = 1024.0
    return {
        "baseline_rss_mib": baseline / mib, "peak_rss_mib": peak / mib,
        "peak_above_baseline_mib": (peak - baseline) / mib, "largest_param_mib": largest / 2**20,
        "bytes": nbytes, "params": params, "seconds": seconds,
    }  # fmt: skip


def measure(folder: Path, dtype: str = "float16", sink: str = "drop") -> dict[str, Any]:
    """Peak RSS above the post-import baseline of a fresh process that loads `folder` (see module doc)."""
    cmd = [sys.executable, "-m", "experiments.load_rss", "--child", str(folder), "--dtype", dtype]
    cmd += ["--sink", sink]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"the measured load failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


EXAMPLE = """\
example (what docs/engine.md quotes; ~16 GB apparent, a few KB on disk, ~1 min on 2 cores):
  python -m experiments.load_rss --shape llama3-8b --dtype float16 --sink drop --out results/load-rss
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.load_rss",
        description="Peak host RSS while streaming a sparse safetensors checkpoint of a named shape.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shape", default="llama3-8b", help="a named dummy shape (stallfree.engine.model.dummy."
                    "SHAPES: smollm2-135m, llama3-8b, mistral-7b, tiny-hd128, qwen3-8b); default llama3-8b")  # fmt: skip
    ap.add_argument("--checkpoint-dtype", choices=sorted(_ST_DTYPES), default="bfloat16",
                    help="dtype stored in the checkpoint (default bfloat16)")  # fmt: skip
    ap.add_argument("--dtype", choices=sorted(_ST_DTYPES), default="float16", help="target dtype the loader "
                    "converts to (default float16: a real conversion from the bf16 checkpoint)")  # fmt: skip
    ap.add_argument("--sink", choices=("drop", "model"), default="drop", help="drop: each parameter dropped "
                    "once whole (the GPU path's host cost); model: a whole model on the host (default drop)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers (default: "
                    "all; each tensor keeps its real size, so the peak is the same, the run shorter)")  # fmt: skip
    ap.add_argument("--dir", default=None, help="where to write the sparse checkpoint (default: a temp dir)")
    ap.add_argument("--out", default=None, help="folder for load_rss.json (default: print only)")
    ap.add_argument("--child", metavar="FOLDER", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(Path(args.child), args.dtype, args.sink)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="stallfree-load-rss-", dir=args.dir) as tmp:
        folder = Path(tmp) / args.shape
        info = write_sparse_checkpoint(folder, args.shape, args.checkpoint_dtype, args.layers)
        result = {"shape": args.shape, "layers": args.layers, "checkpoint_dtype": args.checkpoint_dtype,
                  "dtype": args.dtype, "sink": args.sink, **info, **measure(folder, args.dtype, args.sink)}  # fmt: skip
    print(
        f"{args.shape}: {info['checkpoint_bytes'] / 1e9:.1f} GB in {info['shards']} shards, "
        f"{args.checkpoint_dtype} -> {args.dtype}, sink {args.sink}: peak RSS "
        f"{result['peak_above_baseline_mib']:.0f} MiB above the baseline ({result['baseline_rss_mib']:.0f} MiB); "
        f"largest parameter {result['largest_param_mib']:.0f} MiB; {result['seconds']:.1f} s"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "load_rss.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
