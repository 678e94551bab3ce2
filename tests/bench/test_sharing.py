"""Shared-prefix workloads (system prompt, multi-turn) and the simulator's prefix cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
from bench_factories import make_trace
from costmodel_factories import make_cost_model

from stallfree.bench.metrics import summarize
from stallfree.bench.sharing import Sharing, parse_turns
from stallfree.bench.simulator import SimConfig, simulate
from stallfree.bench.traces import make_workload
from stallfree.slo import Slo


def shared(tmp_path, sharing: Sharing, n: int = 40, qps: float = 1.0, max_model_len: int = 8192):
    trace = replace(make_trace(tmp_path, prompt=100, output=10), sharing=sharing)
    return make_workload(trace, n, qps=qps, max_model_len=max_model_len, seed=3)


def test_system_prompt_workload_shares_exactly_the_system_prompt(tmp_path):
    wl = shared(tmp_path, Sharing("system-prompt", system_prompt_tokens=300))
    prompts = [r.token_ids(wl.seed) for r in wl.requests]
    assert all(len(p) == r.prompt_tokens for p, r in zip(prompts, wl.requests, strict=True))
    assert len({tuple(p[:300]) for p in prompts}) == 1  # one system prompt
    assert len({tuple(p[300:310]) for p in prompts}) == len(prompts)  # the user turns differ
    assert wl.describe()["sharing"] == {"kind": "system-prompt", "system_prompt_tokens": 300}


def test_multi_turn_prompts_resend_the_conversation_so_far(tmp_path):
    wl = shared(tmp_path, Sharing("multi-turn", min_turns=3, max_turns=6, conversations=4), n=60)
    by_slot: dict[int, list[list[int]]] = {}
    for i, r in enumerate(sorted(wl.requests, key=lambda r: r.arrival)):
        by_slot.setdefault(i % 4, []).append(r.token_ids(wl.seed))
    turns_seen = []
    for prompts in by_slot.values():
        run = 1
        for prev, cur in zip(prompts, prompts[1:], strict=False):
            if cur[: len(prev)] == prev:  # the next turn: previous prompt + its answer + a new user turn
                assert len(cur) > len(prev)
                run += 1
            else:
                turns_seen.append(run)
                run = 1
    assert turns_seen and all(3 <= t <= 6 for t in turns_seen)


def test_multi_turn_conversations_restart_before_exceeding_the_context(tmp_path):
    wl = shared(
        tmp_path, Sharing("multi-turn", min_turns=6, max_turns=6, conversations=1), n=30, max_model_len=400
    )
    assert all(r.prompt_tokens + r.output_tokens <= 400 for r in wl.requests)


def test_bad_sharing_options_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        Sharing("chat")
    with pytest.raises(ValueError, match="--turns"):
        Sharing("multi-turn", min_turns=5, max_turns=3)
    with pytest.raises(ValueError, match="--turns"):
        parse_turns("three")
    assert parse_turns("3-6") == (3, 6) and parse_turns("4") == (4, 4)


def test_simulated_prefix_cache_cuts_ttft_on_a_shared_system_prompt(tmp_path):
    wl = shared(tmp_path, Sharing("system-prompt", system_prompt_tokens=1000), n=40, qps=0.5)
    slo = Slo(ttft_p99=60, tbt_p99=10)
    cost = make_cost_model()
    on = summarize(simulate(wl, cost, SimConfig(token_budget=256)).records, slo)
    off = summarize(simulate(wl, cost, SimConfig(token_budget=256, enable_prefix_caching=False)).records, slo)
    assert on["ttft_s"]["p50"] * 3 < off["ttft_s"]["p50"]


def test_simulator_without_sharing_is_the_same_with_caching_on_or_off(tmp_path):
    """Every request has its own ids: nothing hits, so the prefix cache changes no simulated time."""
    wl = make_workload(make_trace(tmp_path), 40, qps=1.0, seed=1)
    on = simulate(wl, make_cost_model(), SimConfig(token_budget=128))
    off = simulate(wl, make_cost_model(), SimConfig(token_budget=128, enable_prefix_caching=False))
    assert [r.token_times for r in on.records] == [r.token_times for r in off.records]
