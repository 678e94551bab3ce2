"""The multi-node rank contract with two "nodes" on this host: the leader (this process, STALLFREE_NODE_RANK=0)
and a follower started as `stallfree serve --tensor-parallel-size 2` with STALLFREE_NODE_RANK=1, which runs
rank 1 only (it loads the model itself and serves no HTTP). TP=2 across them matches TP=1."""

import pytest
from parallel_helpers import make_parallel_llm, prompts_for, run, two_local_nodes


@pytest.mark.slow
def test_two_local_nodes_match_single_process(default_model, monkeypatch):
    prompts = prompts_for(default_model.tokenizer, [17, 120])
    with two_local_nodes(monkeypatch) as follower:
        ref = run(make_parallel_llm(default_model, token_budget=64), prompts)
        llm = make_parallel_llm(default_model, tp=2, token_budget=64)
        assert sorted(llm.engine.executor.procs) == [0]  # rank 1 lives on the other "node"
        got = run(llm, prompts)
        llm.engine.shutdown()
        assert follower.wait(timeout=60) == 0, follower.stdout.read()
    for (lp, toks), (ref_lp, ref_toks) in zip(got, ref, strict=True):
        assert toks == ref_toks
        common = set(lp) & set(ref_lp)
        assert max(abs(lp[t] - ref_lp[t]) for t in common) < 2e-3
