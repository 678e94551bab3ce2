"""--load-format dummy under tensor parallelism. On one host the ranks share the leader's random weights;
across nodes a rank builds them itself from the same shape, dtype and seed, so they must come out equal:
two local "nodes" (this process as leader, a `stallfree serve` follower running rank 1) at TP=2 compute
what one process computes with the same seed."""

from __future__ import annotations

import json

import pytest
from parallel_helpers import run, two_local_nodes

from stallfree.engine import LLM

SMALL = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
}  # fmt: skip
PROMPTS = [list(range(10, 27)), list(range(300, 360))]


def dummy_llm(config: str, tp: int = 1, seed: int = 7) -> LLM:
    return LLM(model=config, load_format="dummy", seed=seed, device="cpu", dtype="float32", num_kv_blocks=64,
               max_num_seqs=4, token_budget=64, tensor_parallel_size=tp)  # fmt: skip


@pytest.mark.slow
def test_a_remote_rank_builds_the_same_random_weights(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    ref = run(dummy_llm(str(config)), PROMPTS)
    other_seed = run(dummy_llm(str(config), seed=8), PROMPTS)
    assert [lp for lp, _ in other_seed] != [lp for lp, _ in ref]  # the seed is what makes them agree
    with two_local_nodes(monkeypatch) as follower:
        llm = dummy_llm(str(config), tp=2)
        assert sorted(llm.engine.executor.procs) == [0]  # rank 1 lives on the other "node"
        got = run(llm, PROMPTS)
        llm.engine.shutdown()
        assert follower.wait(timeout=60) == 0, follower.stdout.read()
    for (lp, toks), (ref_lp, ref_toks) in zip(got, ref, strict=True):
        assert toks == ref_toks
        assert max(abs(lp[t] - ref_lp[t]) for t in set(lp) & set(ref_lp)) < 2e-3
