"""Helpers for the multi-process parallel tests (real worker ranks over gloo, CPU, fp32)."""

from __future__ import annotations

from dataclasses import replace

from engine_helpers import prompt_ids

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.scheduler import Scheduler

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
