"""Peak host RSS of the streaming safetensors loader (experiments.load_rss), in a fresh process.

Issue target: loading an 8B checkpoint keeps the host's peak RSS under 2 GB above the process baseline.
The checkpoint is the llama3-8b shape written sparse (real per-tensor sizes, zeros, a few KB on disk); to
keep CI short it has 4 of the 32 decoder layers: every tensor still has its real size, and the peak is
set by the largest one (the 1 GB embedding / LM head), not by how many there are. `python -m experiments.load_rss
--shape llama3-8b` (docs/engine.md) measures all 32 layers.
"""

from __future__ import annotations

from pathlib import Path

from experiments.load_rss import measure, write_sparse_checkpoint

MIB = 2**20


def test_8b_shaped_checkpoint_streams_under_2gb_above_baseline(tmp_path: Path) -> None:
    """bf16 checkpoint -> float16 (a real conversion), each parameter dropped once whole (the GPU path's
    shape: its destination would be device memory). The peak is one parameter plus a chunk or two:
    holding a second copy of the embedding (a whole tensor read at once, or a shard left mapped) would
    exceed largest + 512 MiB."""
    info = write_sparse_checkpoint(tmp_path / "llama3-8b", "llama3-8b", "bfloat16", layers=4)
    assert info["checkpoint_bytes"] > 3.8e9 and info["shards"] == 1
    r = measure(tmp_path / "llama3-8b", dtype="float16", sink="drop")
    assert r["bytes"] == info["checkpoint_bytes"] and r["params"] == 3 + 4 * 6
    assert r["largest_param_mib"] == 128256 * 4096 * 2 / MIB
    assert r["peak_above_baseline_mib"] < 2048, r
    assert r["peak_above_baseline_mib"] < r["largest_param_mib"] + 512, r


def test_a_whole_model_on_the_host_costs_its_bytes_and_little_more(tmp_path: Path) -> None:
    """The real loader into a host model (smollm2-135m shape, bf16 -> bf16): the peak is the model's own
    bytes plus the loader's overhead, not the checkpoint twice (a dict of every tensor, then the model)."""
    write_sparse_checkpoint(tmp_path / "smollm2", "smollm2-135m", "bfloat16")
    r = measure(tmp_path / "smollm2", dtype="bfloat16", sink="model")
    model_mib = r["bytes"] / MIB
    assert model_mib > 250  # 134.5M parameters in bf16
    assert r["peak_above_baseline_mib"] < model_mib + 160, r
