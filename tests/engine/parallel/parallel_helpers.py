"""Helpers for the multi-process parallel tests (real worker ranks over gloo, CPU, fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace

from engine_helpers import prompt_ids

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.scheduler import Scheduler
from stallfree.ports import free_port

TOP = 20  # first-token log-probabilities compared: the 20 most likely tokens


def make_parallel_llm(loaded, tp: int = 1, pp: int = 1, **kw) -> LLM:
    return LLM(
        loaded_model=loaded, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=200,
        max_num_seqs=16, token_budget=kw.pop("token_budget", 4096), **kw,
    )  # fmt: skip


def set_policy(llm: LLM, policy: str, token_budget: int) -> None:
    """Swap the scheduler of an idle engine (the workers and their KV cache stay)."""
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    cfg = eng.scheduler.config
    tunables = replace(cfg.tunables, token_budget=token_budget)
    eng.scheduler = Scheduler(replace(cfg, policy=policy, tunables=tunables), eng.block_manager)


def run(llm: LLM, prompts, max_tokens: int = 6):
    """[(first-token top-20 {id: logprob}, greedy output ids)] per prompt."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(dict(o.logprobs[0].top), o.token_ids) for o in outs]


def prompts_for(tokenizer, lengths):
    return [prompt_ids(tokenizer, n)[k:] for k, n in enumerate(lengths)]


@contextmanager
def two_local_nodes(monkeypatch):
    """A follower `stallfree serve --tensor-parallel-size 2` running rank 1 as node 1 of 2, with this process
    set up as the leader (node 0). Yields the follower; it must exit cleanly once the leader shuts down."""
    env = {
        "STALLFREE_NUM_NODES": "2",
        "STALLFREE_LEADER_ADDRESS": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "STALLFREE_CONTROL_PORT": str(free_port()),
        "STALLFREE_PARALLEL_AUTHKEY": "test-secret",
        "OMP_NUM_THREADS": "1",
    }
    follower = subprocess.Popen(
        [sys.executable, "-m", "stallfree", "serve", "--tensor-parallel-size", "2"],
        env={**os.environ, **env, "STALLFREE_NODE_RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for k, v in {**env, "STALLFREE_NODE_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    try:
        yield follower
    finally:
        if follower.poll() is None:
            follower.kill()
