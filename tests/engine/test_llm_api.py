"""The offline API in the shape vLLM users know."""

import pytest
from engine_helpers import greedy, make_llm

from stallfree.engine import LLM


def test_generate_strings_and_token_ids(default_model):
    llm = make_llm(default_model)
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    by_text, by_ids = llm.generate(["The capital of France is", ids], greedy(8), use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) <= 8
    assert by_text.text == tok.decode(by_text.token_ids)
    assert by_text.finish_reason in ("stop", "length")


def test_chat_applies_the_template(default_model):
    llm = make_llm(default_model)
    msgs = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
    out = llm.chat(msgs, greedy(12), use_tqdm=False)[0]
    expected = llm.get_tokenizer().encode_chat(msgs)
    assert out.prompt_token_ids == expected
    assert out.text.strip(), "the model said nothing"


def test_outputs_come_back_in_prompt_order(default_model):
    llm = make_llm(default_model, token_budget=32)
    prompts = ["a " * 50, "Hello", "b " * 20]
    outs = llm.generate(prompts, greedy(3), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.get_tokenizer().encode(p) for p in prompts]


def test_bad_arguments_raise_actionable_errors(default_model):
    with pytest.raises(ValueError, match="token_budget"):
        LLM(loaded_model=default_model, token_budget=-5)
    with pytest.raises(ValueError, match="policy"):
        LLM(loaded_model=default_model, policy="fifo")
    with pytest.raises(ValueError, match="dtype"):
        LLM(loaded_model=default_model, dtype="int3")
    llm = make_llm(default_model, max_model_len=64)
    with pytest.raises(ValueError, match="shorten the prompt"):
        llm.generate(["word " * 100], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy(2)] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(2), use_tqdm=False)
    # Nothing half-queued is left behind by a rejected batch.
    assert not llm.engine.has_unfinished_requests()
