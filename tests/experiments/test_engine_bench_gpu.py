"""The GPU engine benchmark's harness, run end to end on CPU tensors through Triton's interpreter.

It measures nothing meaningful here (the figures come from the H200: docs/gpu.md); it checks that every
measurement runs, that the JSON carries the keys docs/figures/gpu/engine.json promises, and that a backend
that fails is reported without losing the others.
"""

from __future__ import annotations

import json
import os
from argparse import Namespace

import pytest

from experiments.engine_bench_gpu import Plan, main

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-only harness check")


def test_the_harness_writes_every_figure_and_survives_a_failing_backend(tmp_path, monkeypatch):
    import torch

    from stallfree.engine.model import dummy

    monkeypatch.setitem(
        dummy.SHAPES, "harness-tiny",
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2),
    )  # fmt: skip
    torch.set_num_threads(1)
    plan = Plan(
        batches=(1, 2),
        context=16,
        prompt=48,
        budgets=(16, 32),
        hybrid_decodes=2,
        hybrid_chunk=16,
        device="cpu",
    )
    args = Namespace(dtype="float32", out=str(tmp_path), load_format="dummy", shape="harness-tiny", model=None,
                     backends="triton,flashinfer", steps=3)  # fmt: skip
    assert main(args, plan) == 0
    result = json.loads((tmp_path / "engine.json").read_text())
    for key in ("backend", "decode_ms", "decode_floor_ms", "prefill_4096_ms", "prefill_4096_floor_ms",
                "chunked_over_oneshot", "hybrid_over_chunk"):  # fmt: skip
        assert key in result, key
    assert result["backend"] == "triton"
    assert set(result["decode_ms"]) == {"1", "2"} and set(result["chunked_over_oneshot"]) == {"16", "32"}
    assert all(v > 0 for v in result["decode_ms"].values())
    assert "error" in result["backends"]["flashinfer"]  # no CUDA here: reported, not fatal
    launches = result["backends"]["triton"]["launches"]
    assert set(launches) == {"decode_2", "hybrid_2_plus_16"}
    # the plan travels with the figures, so a cost model fitted to them times the iterations that ran
    from stallfree.bench.figuresfit import observations

    assert result["plan"]["prompt"] == 48 and result["plan"]["decode_steps"] == 3
    timed, _ = observations(result, knee=0.0)
    assert {r["name"] for r in timed} >= {
        "one-shot 48 prefill",
        "48 prompt at budget 16",
        "2 decodes + 16-token chunk",
    }
    assert next(r for r in timed if r["name"] == "48 prompt at budget 16")["iterations"] == 3
