"""The one `auto` resolver (stallfree.engine.placement): what device, dtype and quantization `auto` means
on the CPU, on CUDA, with worker ranks and with a model already loaded; the impossible combinations are
refused with what to do instead. The same function serves LLM(), `stallfree serve` and the parallel engine
(test_serve_matches_llm.py checks the first two agree end to end)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import TINY

from stallfree.engine.model.cpu_linear import pack_for_cpu
from stallfree.engine.model.dummy import build_dummy_model, synthetic_tokenizer
from stallfree.engine.model.loader import LoadedModel
from stallfree.engine.placement import Placement, resolve_placement

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: True)


def test_one_cpu_process_runs_bf16_with_int4_weights(no_gpu):
    assert resolve_placement() == Placement(CPU, BF16, "int4")
    assert resolve_placement("cpu", "bfloat16") == Placement(CPU, BF16, "int4")
    assert resolve_placement("cpu", quantization="none") == Placement(CPU, BF16, "none")
    assert resolve_placement("cpu", quantization="int8") == Placement(CPU, BF16, "int8")


def test_float32_stays_the_exact_reference_one_flag_away(no_gpu):
    assert resolve_placement("cpu", "float32") == Placement(CPU, FP32, "none")
    assert resolve_placement("cpu", "float16") == Placement(CPU, FP16, "none")
    with pytest.raises(ValueError, match="multiplies bf16 activations: use dtype bfloat16"):
        resolve_placement("cpu", "float32", "int4")


def test_cpu_worker_ranks_run_float32_unquantized(no_gpu):
    assert resolve_placement(world_size=2) == Placement(CPU, FP32, "none")
    assert resolve_placement("cpu", "bfloat16", world_size=4) == Placement(CPU, BF16, "none")
    with pytest.raises(ValueError, match="single-process CPU engine only"):
        resolve_placement("cpu", quantization="int4", world_size=2)


def test_cuda_runs_bf16_or_fp16_without_bf16_and_never_quantizes(gpu, monkeypatch):
    assert resolve_placement() == Placement(CUDA, BF16, "none")
    assert resolve_placement("cuda:1", world_size=8) == Placement(torch.device("cuda:1"), BF16, "none")
    assert resolve_placement("auto", "float32") == Placement(CUDA, FP32, "none")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_placement("cuda", quantization="int4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: False)
    assert resolve_placement().dtype == FP16
    assert resolve_placement("cpu") == Placement(CPU, BF16, "int4")  # asked for the CPU: the CPU's rules


def test_a_loaded_model_decides_what_auto_means(no_gpu):
    fp32 = LoadedModel(build_dummy_model(TINY, FP32, "cpu", seed=0), synthetic_tokenizer(512), TINY, "t")
    assert resolve_placement(loaded=fp32) == Placement(CPU, FP32, "none")
    assert resolve_placement("cpu", "float16", loaded=fp32).dtype == FP16  # explicit stays explicit


def test_a_loaded_packed_model_reports_its_quantization(no_gpu):
    model = build_dummy_model(TINY, FP32, "cpu", seed=0)
    pack_for_cpu(model, "int8")
    for p in model.parameters():
        p.data = p.data.to(BF16)
    loaded = LoadedModel(model, synthetic_tokenizer(512), TINY, "t")
    assert resolve_placement(loaded=loaded) == Placement(CPU, BF16, "int8")


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"dtype": "fp8"}, "dtype must be one of auto, float32"),
        ({"quantization": "int2"}, "quantization must be one of auto, none, int8, int4"),
        ({"device": "tpu:x"}, "device must be auto, cpu or cuda[:N]"),
    ],
)
def test_unknown_names_are_refused(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        resolve_placement(**kw)
