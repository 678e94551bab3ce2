"""Chunked prefill computes what one-shot prefill computes, under every budget and policy.

Tolerance: fp32 on CPU; chunking changes only the grouping of the same sums, so the first generated token's
logits agree within ATOL (absolute, logits are O(10)), and greedy outputs are identical. The mutant tests
show the comparison is sharp: positions restarted per chunk, a chunk that sees only itself, or a chunk
that sees its own future all move the logits by far more than ATOL.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_helpers import first_logits_and_greedy, greedy, make_llm, prompt_ids

import stallfree.engine.attention.cpu_backend as cpu_backend_mod
import stallfree.engine.attention.torch_backend as torch_backend_mod
import stallfree.engine.model_runner as runner_mod

ATOL = 2e-3
LENGTHS = [15, 16, 17, 31, 33, 300, 1000]
BUDGETS = [16, 17, 64, 257, 512]


@pytest.fixture(scope="module")
def one_shot(default_model):
    """Reference: each prompt prefilled in one iteration (budget larger than any prompt)."""
    tok = default_model.tokenizer
    return {n: first_logits_and_greedy(default_model, prompt_ids(tok, n)) for n in LENGTHS}


@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_matches_one_shot_for_every_budget(default_model, one_shot, n):
    ref_logits, ref_tokens = one_shot[n]
    ids = prompt_ids(default_model.tokenizer, n)
    for budget in BUDGETS:
        if budget >= n and budget != BUDGETS[0]:
            continue  # one chunk: same as one-shot
        logits, tokens = first_logits_and_greedy(default_model, ids, token_budget=budget)
        diff = (logits - ref_logits).abs().max().item()
        assert diff < ATOL, f"prompt {n}, budget {budget}: logits differ by {diff}"
        assert tokens == ref_tokens, f"prompt {n}, budget {budget}: greedy output changed"


@pytest.mark.parametrize("policy", ["vllm", "orca", "static"])
def test_baseline_policies_match_sarathi(default_model, one_shot, policy):
    for n in (17, 300):
        ids = prompt_ids(default_model.tokenizer, n)
        logits, tokens = first_logits_and_greedy(default_model, ids, policy=policy, token_budget=64)
        assert (logits - one_shot[n][0]).abs().max().item() < ATOL
        assert tokens == one_shot[n][1]


def test_mixed_batches_give_each_request_its_solo_output(default_model):
    tok = default_model.tokenizer
    prompts = [prompt_ids(tok, n)[k:] for k, n in enumerate([40, 150, 17, 90, 260])]
    solo = [make_llm(default_model).generate([p], greedy(10), use_tqdm=False)[0].token_ids for p in prompts]
    for policy, budget in [("sarathi", 32), ("sarathi", 100), ("vllm", 64), ("orca", 64), ("static", 64)]:
        outs = make_llm(default_model, policy=policy, token_budget=budget).generate(
            prompts, greedy(10), use_tqdm=False
        )
        assert [o.token_ids for o in outs] == solo, f"{policy} budget {budget} changed an output"


def _restart_positions(out, block_size):
    hb = ORIG_HOST_BATCH(out, block_size)
    starts = np.concatenate([np.full(c.num_tokens, c.start) for c in out.chunks])
    return replace(hb, positions=hb.positions - starts)  # every chunk starts at position 0


def _chunk_sees_only_itself(batch, block_size):
    meta = ORIG_METADATA(batch, block_size)
    spans = tuple(
        torch_backend_mod.PrefillSpan(p.q_start, p.q_len, 0, p.kv_slots[p.context_len :])
        for p in meta.prefills
    )
    return replace(meta, prefills=spans)


def _chunk_rows_see_only_themselves(batch):
    """The cpu backend's rows: each chunk token sees only the chunk's keys (a history cut at its start)."""
    meta = ORIG_CPU_METADATA(batch)
    hb = batch.host
    starts = np.concatenate(
        [hb.positions[: hb.num_decodes], np.repeat(hb.prefill_ctx_lens, hb.prefill_q_lens)]
    )
    meta.lens.sub_(torch.from_numpy(starts.astype(np.int32)))  # keys 0 .. offset-in-chunk: wrong ones
    return meta


def _sees_the_future(self, q, keys, vals, context_len):
    return ORIG_PREFILL(self, q, keys, vals, context_len + q.shape[0])


ORIG_HOST_BATCH = runner_mod.host_batch
ORIG_METADATA = torch_backend_mod.torch_metadata
ORIG_CPU_METADATA = cpu_backend_mod.cpu_metadata
ORIG_PREFILL = torch_backend_mod.TorchBackend._prefill


@pytest.mark.parametrize(
    "target,attr,mutant",
    [
        (runner_mod, "host_batch", _restart_positions),
        (torch_backend_mod, "torch_metadata", _chunk_sees_only_itself),
        (cpu_backend_mod, "cpu_metadata", _chunk_rows_see_only_themselves),
        (torch_backend_mod.TorchBackend, "_prefill", _sees_the_future),
    ],
    ids=[
        "positions-restart-per-chunk",
        "chunk-sees-only-itself",
        "cpu-chunk-rows-see-only-themselves",
        "chunk-sees-its-future",
    ],  # fmt: skip
)
def test_the_comparison_catches_broken_chunking(default_model, one_shot, monkeypatch, target, attr, mutant):
    monkeypatch.setattr(target, attr, mutant)
    ids = prompt_ids(default_model.tokenizer, 300)
    # The span mutants break the torch backend's prefill spans (the cpu backend attends every row through
    # its paged kernel; _chunk_rows_see_only_themselves is its mutant).
    backend = "torch" if mutant in (_chunk_sees_only_itself, _sees_the_future) else "auto"
    logits, _ = first_logits_and_greedy(default_model, ids, token_budget=64, attention_backend=backend)
    diff = (logits - one_shot[300][0]).abs().max().item()
    assert diff > 100 * ATOL, f"a broken chunked prefill went unnoticed (diff {diff})"


def test_preemption_and_resume_give_the_same_greedy_output(default_model):
    tok = default_model.tokenizer
    prompts = [prompt_ids(tok, 90)[k:] for k in range(0, 40, 10)]
    roomy = make_llm(default_model, token_budget=128).generate(prompts, greedy(30), use_tqdm=False)
    # 24 blocks of 16 tokens cannot hold four requests of ~110 tokens: some must be preempted and recomputed.
    tight_llm = make_llm(default_model, token_budget=128, num_kv_blocks=24)
    tight = tight_llm.generate(prompts, greedy(30), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.engine.block_manager.num_free_blocks == 24
