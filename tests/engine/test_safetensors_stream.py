"""The streaming safetensors loader (stallfree.engine.model.safetensors_stream): same parameters, bit for
bit, as reading every tensor into memory and fusing them (the loader it replaced), whatever the chunking
and sharding; bad checkpoints refused before any data is read. Its memory: tests/experiments/test_load_rss.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_hf_model
from safetensors.torch import load_file, save_file

import stallfree.engine.model.safetensors_stream as stream
from stallfree.engine.model.hf_loader import config_from_hf
from stallfree.engine.model.llama import LlamaForCausalLM


def _folder(tmp_path: Path, arch: str = "qwen2", tie: bool = False, shards: int = 1) -> Path:
    """A random transformers checkpoint saved in bf16, split into `shards` files by tensor order."""
    hf = make_tiny_hf_model(arch, tie=tie).to(torch.bfloat16)
    folder = tmp_path / f"{arch}-{shards}"
    hf.save_pretrained(folder, safe_serialization=True)
    if shards > 1:
        (weights,) = [load_file(str(p)) for p in folder.glob("*.safetensors")]
        for p in folder.glob("*.safetensors"):
            p.unlink()
        names = sorted(weights)
        for i in range(shards):
            part = {n: weights[n].contiguous() for n in names[i::shards]}
            save_file(part, str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return folder


def _config(folder: Path):
    return config_from_hf(json.loads((folder / "config.json").read_text()))


def _all_in_memory(folder: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    weights: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(p)))
    return LlamaForCausalLM.from_hf_state_dict(_config(folder), weights, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("arch", "tie", "shards"), [("qwen2", False, 1), ("llama", True, 3), ("qwen3", False, 2)]
)
def test_streamed_parameters_equal_the_in_memory_ones(
    tmp_path, monkeypatch, dtype, arch, tie, shards
) -> None:
    folder = _folder(tmp_path, arch, tie, shards)
    monkeypatch.setattr(stream, "CHUNK_BYTES", 1000)  # many chunks per tensor, a row or a few each
    got = dict(stream.load_streamed(_config(folder), folder, dtype, "cpu").named_parameters())
    want = dict(_all_in_memory(folder, dtype).named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert got[name].dtype == dtype and torch.equal(got[name], p), name


def _rewrite(folder: Path, edit) -> None:
    (path,) = folder.glob("*.safetensors")
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: w.pop("model.layers.1.self_attn.k_proj.bias"), "missing .*layers.1.self_attn.qkv_proj.bias"),
        (lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), "unexpected .*mlp.extra"),
        (lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}), "up_proj.weight: checkpoint shape"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(65)}), "model.norm.weight: checkpoint shape"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_refused_before_any_data_is_read(tmp_path, monkeypatch, edit, message) -> None:
    folder = _folder(tmp_path)
    _rewrite(folder, edit)

    def no_reads(*_a, **_k):
        raise AssertionError("data was read before the checkpoint was checked")

    monkeypatch.setattr(stream, "read_into", no_reads)
    with pytest.raises(ValueError, match=message):
        stream.load_streamed(_config(folder), folder, torch.float32, "cpu")


def test_a_tensor_in_two_shards_is_refused(tmp_path) -> None:
    folder = _folder(tmp_path, shards=2)
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "model-extra.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight is in both"):
        stream.load_streamed(_config(folder), folder, torch.float32, "cpu")


def test_no_shards(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        stream.list_tensors(tmp_path)
