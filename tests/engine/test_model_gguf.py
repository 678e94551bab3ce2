"""GGUF loading on tiny checkpoints written here: Q/K un-permutation, quantization types, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, ReaderTensor
from gguf.quants import dequantize, quantize
from model_fixtures import (
    hf_logits,
    make_tiny_hf_model,
    prefill_logits,
    train_tiny_tokenizer,
    write_gguf,
)

from stallfree.engine.model import load_model
from stallfree.engine.model.gguf_loader import dequantize_tensor, load_gguf

Q = GGMLQuantizationType
TEXT = "the quick brown fox: def add(a, b): return a + b"


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return train_tiny_tokenizer()


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_gguf_logits_match_hf(tmp_path: Path, tiny_tokenizer, arch: str, tie: bool) -> None:
    """A model written as llama.cpp writes it loads back to the same function (fp32, max |diff| < 1e-4)."""
    hf = make_tiny_hf_model(arch, tie=tie)
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf", hf, tiny_tokenizer, arch=arch))
    assert loaded.config.tie_word_embeddings is tie
    assert loaded.config.qkv_bias is (arch == "qwen2")
    ids = tiny_tokenizer.encode(TEXT).ids
    ours, ref = prefill_logits(loaded.model, ids), hf_logits(hf, ids)
    assert ref.abs().max() > 1.0  # the logits carry signal, so the comparison means something
    assert (ours - ref).abs().max().item() < 1e-4
    assert loaded.tokenizer.encode(TEXT) == ids


def test_rope_permutation_must_be_undone(tmp_path: Path, tiny_tokenizer) -> None:
    """Without un-permuting Q/K the GGUF model computes something else: this test guards the fix."""
    hf = make_tiny_hf_model("llama")
    path = write_gguf(tmp_path / "tiny.gguf", hf, tiny_tokenizer, arch="llama")
    ids = tiny_tokenizer.encode(TEXT).ids
    ref = hf_logits(hf, ids)
    fixed, _, _ = load_gguf(path)
    broken, _, _ = load_gguf(path, undo_rope_permutation=False)
    assert (prefill_logits(fixed, ids) - ref).abs().max().item() < 1e-4
    # The first token attends only to itself, so RoPE cannot matter there; later ones must all differ.
    diff = (prefill_logits(broken, ids) - ref).abs().amax(dim=-1)
    assert diff[0] < 1e-4
    assert diff[1:].min().item() > 1e-2


def test_unpermuted_file_is_not_unpermuted_twice(tmp_path: Path, tiny_tokenizer) -> None:
    """Control: a "llama" file written without the permutation only loads right with the fix disabled."""
    hf = make_tiny_hf_model("llama")
    path = write_gguf(tmp_path / "plain.gguf", hf, tiny_tokenizer, arch="llama", permute=False)
    ids = tiny_tokenizer.encode(TEXT).ids
    ref = hf_logits(hf, ids)
    plain, _, _ = load_gguf(path, undo_rope_permutation=False)
    assert (prefill_logits(plain, ids) - ref).abs().max().item() < 1e-4
    assert (prefill_logits(load_model(path).model, ids) - ref).abs().max().item() > 1e-2


# Largest error one element may have after a round trip, from each format's definition, per 32-block:
# one quantization step (rounding is half a step; Q4_0 clips the top code, fp16 scales add a little).
def _step(block: np.ndarray, qtype: Q) -> np.ndarray:
    amax = np.abs(block).max(axis=-1, keepdims=True)
    if qtype == Q.Q8_0:
        return amax / 127
    if qtype == Q.Q4_0:
        return amax / 8
    return (block.max(axis=-1, keepdims=True) - block.min(axis=-1, keepdims=True)) / 15  # Q4_1


def _roundtrip(tmp_path: Path, data: np.ndarray, qtype: Q) -> torch.Tensor:
    """Write `data` as one tensor of type `qtype` and dequantize it back through our loader's function."""
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    if qtype in (Q.F32, Q.F16):
        w.add_tensor("t", data.astype(np.float32 if qtype == Q.F32 else np.float16))
    else:
        w.add_tensor("t", quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = GGUFReader(tmp_path / "t.gguf").tensors
    assert tensor.tensor_type == qtype
    return dequantize_tensor(tensor)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32])
def test_dequantize_within_quantization_error(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 2.0, size=(48, 1))).astype(np.float32)
    out = _roundtrip(tmp_path, data, qtype)
    assert out.dtype == torch.float32 and tuple(out.shape) == (48, 96)  # rows x cols, not transposed
    err = np.abs(out.numpy() - data)
    if qtype == Q.F32:
        assert err.max() == 0
    elif qtype == Q.F16:
        assert (err <= np.abs(data) * 2.0**-11 + 1e-7).all()  # round to nearest, 11-bit significand
    elif qtype == Q.BF16:
        assert (err <= np.abs(data) * 2.0**-8).all()  # round to nearest, 8-bit significand
    else:
        blocks, err_blocks = data.reshape(-1, 32), err.reshape(-1, 32)
        assert (err_blocks <= 1.01 * _step(blocks, qtype) + 1e-6).all()
        # Rounding error is uniform over +-step/2: its RMS is step/sqrt(12), far below one step.
        assert np.sqrt((err_blocks**2).mean()) < 0.5 * _step(blocks, qtype).mean()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.BF16, Q.F16])
def test_quantized_model_matches_hf_with_the_same_rounding(tmp_path: Path, tiny_tokenizer, qtype: Q) -> None:
    """A model stored quantized computes exactly what the HF model computes with its matrices rounded the
    same way (quantize -> dequantize with the gguf package): fp32, max |diff| < 1e-4. So every quantized
    tensor lands in the right place, un-permuted; the quantization error itself is checked above."""
    hf = make_tiny_hf_model("llama")
    path = write_gguf(tmp_path / "q.gguf", hf, tiny_tokenizer, qtype=qtype)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), qtype), qtype)).reshape(p.shape))
    ids = tiny_tokenizer.encode(TEXT).ids
    assert (prefill_logits(load_model(path).model, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_unsupported_quantization_type_is_refused() -> None:
    fake = ReaderTensor(
        name="blk.0.attn_q.weight",
        tensor_type=Q.IQ2_XXS,
        shape=np.array([256, 1], dtype=np.uint32),
        n_elements=256,
        n_bytes=66,
        data_offset=0,
        data=np.zeros((1, 66), dtype=np.uint8),
        field=None,  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        dequantize_tensor(fake)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    w = GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'"):
        load_model(tmp_path / "bert.gguf")


def test_missing_and_wrong_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="must be .gguf"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "bad.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama31_rope_freqs_tensor(tmp_path: Path, tiny_tokenizer) -> None:
    """Llama 3.1 GGUFs carry their RoPE scaling as per-frequency divisors (`rope_freqs`); they must apply."""
    hf = make_tiny_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    head_dim = 16
    plain = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    factors = plain / hf.model.rotary_emb.inv_freq.double().numpy()  # what llama.cpp's converter stores
    assert factors.max() > 3.9 and factors.min() == pytest.approx(1.0)
    loaded = load_model(write_gguf(tmp_path / "l31.gguf", hf, tiny_tokenizer, rope_freqs=factors))
    assert loaded.config.rope_freq_factors is not None
    ids = tiny_tokenizer.encode(TEXT).ids
    ref = hf_logits(hf, ids)
    assert (prefill_logits(loaded.model, ids) - ref).abs().max().item() < 1e-4
    unscaled = load_model(write_gguf(tmp_path / "plain.gguf", hf, tiny_tokenizer))
    assert (prefill_logits(unscaled.model, ids) - ref).abs().max().item() > 1e-2


def test_linear_rope_scaling(tmp_path: Path, tiny_tokenizer) -> None:
    hf = make_tiny_hf_model(
        "llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    )
    loaded = load_model(write_gguf(tmp_path / "lin.gguf", hf, tiny_tokenizer, linear_rope_factor=2.0))
    assert loaded.config.rope_freq_factors == (2.0,) * 8
    ids = tiny_tokenizer.encode(TEXT).ids
    assert (prefill_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
