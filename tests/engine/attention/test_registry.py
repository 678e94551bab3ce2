"""The attention-backend registry: the backends describe themselves (devices, dtypes, where `auto` may
take them, availability), the registry loops over them for `auto`, clear errors for impossible choices, the
fallback, and what each backend declares instead of being asked its name."""

from __future__ import annotations

import logging

import pytest
import torch
from cuda_helpers import TINY

from stallfree.engine import LLM
from stallfree.engine.attention import BACKENDS, FALLBACK, backend_class, resolve_attention_backend
from stallfree.engine.attention import registry as registry_mod
from stallfree.engine.config import EngineConfig
from stallfree.engine.kernels import cpu_fused
from stallfree.engine.model.dummy import build_dummy_model, synthetic_tokenizer
from stallfree.engine.model.loader import LoadedModel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_registry_names_every_backend_and_the_config_takes_those_names() -> None:
    assert {backend_class(n).name for n in BACKENDS} == set(BACKENDS) and FALLBACK in BACKENDS
    for name in ("auto", *BACKENDS):
        assert EngineConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; choose auto, cpu, triton"):
        EngineConfig(attention_backend="fast")


def test_backends_describe_their_devices_and_dtypes() -> None:
    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    declared = {n: (backend_class(n).devices, backend_class(n).auto_dtypes) for n in BACKENDS}
    assert declared == {
        "cpu": ({"cpu"}, {fp32, bf16, fp16}),
        "triton": ({"cuda"}, {bf16, fp16}),
        "torch": ({"cpu", "cuda"}, {fp32, bf16, fp16}),
        "flashinfer": ({"cuda"}, set()),  # by name only
    }
    assert backend_class("flashinfer").dtypes == {bf16, fp16}


def test_auto_takes_the_first_available_backend_in_the_registrys_order(monkeypatch, caplog) -> None:
    """On CUDA in bf16: triton, or torch (with a warning) where triton is missing."""
    triton_b = backend_class("triton")
    monkeypatch.setattr(triton_b, "unavailable", classmethod(lambda cls: None))
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16) == "triton"
    monkeypatch.setattr(triton_b, "unavailable", classmethod(lambda cls: "triton is not installed"))
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend("auto", CUDA, torch.bfloat16) == "torch"
    assert "the triton attention backend is not available (triton is not installed)" in caplog.text


def test_auto_follows_the_products_rules(monkeypatch) -> None:
    monkeypatch.setattr(cpu_fused, "available", lambda: True)
    assert resolve_attention_backend("auto", CPU, torch.float32) == "cpu"
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    assert resolve_attention_backend("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_attention_backend("auto", CUDA, torch.float32) == "torch"  # no fp32 fast path


@pytest.mark.parametrize(
    "name, device, dtype, message",
    [
        ("fast", CPU, torch.float32, "unknown attention backend 'fast'"),
        ("flashinfer", CPU, torch.bfloat16, "needs a CUDA device"),
        ("cpu", CUDA, torch.bfloat16, "needs the CPU: on cuda in bfloat16 use attention_backend auto or"),
        ("flashinfer", CUDA, torch.float32, "no float32 kernels: .* auto or triton, torch$"),
    ],
)
def test_impossible_choices_are_refused_with_a_reason(name, device, dtype, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(name, device, dtype)


def test_triton_off_cuda_only_through_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", CPU, torch.float32) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("triton", CPU, torch.float32)


def test_backends_declare_what_the_runner_does_around_them() -> None:
    torch_b, cpu_b = backend_class("torch"), backend_class("cpu")
    triton_b, fi_b = backend_class("triton"), backend_class("flashinfer")
    assert not torch_b.supports_graphs and not torch_b.samples_on_device and not torch_b.compiles_kernels
    assert not cpu_b.supports_graphs and not cpu_b.samples_on_device
    assert triton_b.supports_graphs and triton_b.compiles_kernels and triton_b.samples_on_device
    assert not fi_b.supports_graphs and fi_b.compiles_kernels and fi_b.samples_on_device
    assert {b.name for b in (torch_b, cpu_b, triton_b, fi_b)} == set(BACKENDS)


def _tiny() -> LoadedModel:
    return LoadedModel(
        build_dummy_model(TINY, torch.float32, "cpu", seed=0), synthetic_tokenizer(512), TINY, "tiny"
    )


def test_the_torch_backend_runs_plain_ops_and_needs_no_warm_up() -> None:
    llm = LLM(
        loaded_model=_tiny(), attention_backend="torch", device="cpu", dtype="float32", num_kv_blocks=16
    )
    runner = llm.engine.executor.runner
    assert runner.backend.name == "torch" and runner.backend.kernels is None and runner.graphs is None
    assert runner.warm_up() == 0.0
    assert all(not k.any() for k in runner.cache.k), "a warm-up wrote K/V it did not need"


def test_auto_falls_back_loudly_when_its_choice_cannot_start(monkeypatch, caplog) -> None:
    class Broken(backend_class("cpu")):  # describes itself as the cpu backend, then cannot start
        def __init__(self, *args) -> None:
            raise RuntimeError("kernel build failed")

    monkeypatch.setattr(registry_mod, "_auto", lambda device, dtype: "cpu")
    real = registry_mod.backend_class
    monkeypatch.setattr(registry_mod, "backend_class", lambda name: Broken if name == "cpu" else real(name))
    with caplog.at_level(logging.WARNING):
        llm = LLM(loaded_model=_tiny(), device="cpu", dtype="float32", num_kv_blocks=16)
    assert llm.engine.executor.runner.backend.name == FALLBACK
    assert "could not build its kernels" in caplog.text and "kernel build failed" in caplog.text
    with pytest.raises(RuntimeError, match="kernel build failed"):  # asked for by name: no fallback
        LLM(loaded_model=_tiny(), attention_backend="cpu", device="cpu", dtype="float32", num_kv_blocks=16)
