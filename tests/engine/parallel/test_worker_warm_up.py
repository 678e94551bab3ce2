"""Worker ranks warm their runners up before the engine is ready: with a backend that compiles its kernels
(Triton, through its interpreter here), every rank runs the warm-up batch at once (it crosses the pipeline
stages and the tensor-parallel collectives like any micro-batch), captures its CUDA graphs where the device
has them (not here), and reports to the leader; the outputs then equal one process's."""

from __future__ import annotations

import json
import logging
import os

import pytest
from parallel_helpers import run

from stallfree.engine import LLM

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter on CPU"
)
SMALL = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
}  # fmt: skip
PROMPTS = [list(range(10, 27)), list(range(300, 360)), [5, 6, 7]]


def small_llm(config: str, **kw) -> LLM:
    return LLM(model=config, load_format="dummy", seed=3, device="cpu", dtype="float32", num_kv_blocks=64,
               max_num_seqs=4, token_budget=32, attention_backend="triton", **kw)  # fmt: skip


@pytest.mark.parametrize(
    "layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}], ids=["pp2", "tp2"]
)
def test_every_rank_warms_up_before_ready_and_outputs_do_not_change(tmp_path, caplog, layout):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    ref = run(small_llm(str(config)), PROMPTS)
    with caplog.at_level(logging.INFO, logger="stallfree.engine.parallel.executor"):
        llm = small_llm(str(config), **layout)
    try:
        assert any("worker ranks warmed up" in r.getMessage() for r in caplog.records), caplog.text
        got = run(llm, PROMPTS)
    finally:
        llm.engine.shutdown()
    for i, ((lp, toks), (ref_lp, ref_toks)) in enumerate(zip(got, ref, strict=True)):
        assert toks == ref_toks, f"prompt {i}: greedy output changed"
        common = set(lp) & set(ref_lp)
        assert max(abs(lp[t] - ref_lp[t]) for t in common) < 2e-3, f"prompt {i}: logprobs differ"
