"""Sampling and stopping on the real model: seeds, top-k, top-p, stop strings and ids, logprobs."""

import pytest
from engine_helpers import greedy, make_llm, prompt_ids

from stallfree.engine import SamplingParams


@pytest.fixture(scope="module")
def llm(default_model):
    return make_llm(default_model, token_budget=256)


@pytest.fixture(scope="module")
def prompt(default_model):
    return default_model.tokenizer.encode("Once upon a time, in a small village by the sea,")


def test_seed_reproduces_whatever_shares_the_batch(llm, prompt, default_model):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    others = [prompt_ids(default_model.tokenizer, n) for n in (30, 70)]
    mixed = llm.generate(
        [others[0], prompt, others[1]],
        [SamplingParams(max_tokens=12, temperature=1.0), sp, SamplingParams(max_tokens=5, temperature=0.7)],
        use_tqdm=False,
    )[1].token_ids
    assert alone == mixed
    other_seed = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=99), use_tqdm=False
    )
    assert other_seed[0].token_ids != alone


def test_top_k_one_equals_greedy(llm, prompt):
    g = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    k1 = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.3, top_k=1), use_tqdm=False)[0]
    assert k1.token_ids == g.token_ids


def test_tiny_top_p_equals_greedy(llm, prompt):
    g = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    p = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=3), use_tqdm=False
    )
    assert p[0].token_ids == g.token_ids


def test_stop_string_cuts_the_text_before_the_match(llm, prompt):
    full = llm.generate([prompt], greedy(24), use_tqdm=False)[0]
    words = full.text.split()
    assert len(words) > 4, full.text
    stop = words[3]
    cut = full.text.index(stop)
    out = llm.generate([prompt], greedy(24, stop=[stop]), use_tqdm=False)[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([prompt], greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == full.text[: cut + len(stop)]


def test_stop_token_id_ends_after_the_token(llm, prompt):
    full = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_max_tokens_gives_length(llm, prompt):
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_logprobs_are_the_models_distribution(llm, prompt):
    out = llm.generate([prompt], greedy(5, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_min_tokens_suppresses_stop_tokens(llm, prompt):
    full = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    stop_id = full.token_ids[1]
    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop_id], min_tokens=6), use_tqdm=False)[0]
    assert len(out.token_ids) >= 6
    assert stop_id not in out.token_ids[:5]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(logprobs=50), "logprobs"),
        (dict(min_tokens=9, max_tokens=3), "min_tokens"),
    ],
)
def test_bad_sampling_params_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_penalised_neighbours_leave_plain_requests_bit_identical(llm, prompt, default_model):
    """Greedy requests without penalties give the same tokens and logprobs whether or not penalised and
    biased requests share their batches (which themselves do change their own outputs)."""
    plain = greedy(16, logprobs=3)
    alone = llm.generate([prompt], plain, use_tqdm=False)[0]
    other = prompt_ids(default_model.tokenizer, 40)
    pen = greedy(16, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3,
                 logit_bias={int(alone.token_ids[0]): -100.0})  # fmt: skip
    outs = llm.generate([other, prompt, prompt], [pen, plain, pen], use_tqdm=False)
    assert outs[1].token_ids == alone.token_ids
    assert [lp.logprob for lp in outs[1].logprobs] == pytest.approx(
        [lp.logprob for lp in alone.logprobs], abs=1e-5
    )
    assert outs[2].token_ids[0] != alone.token_ids[0]  # banned by its logit_bias
