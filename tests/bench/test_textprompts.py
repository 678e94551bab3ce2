"""Text prompts for string-only servers: exact token counts on the bundled model's tokenizer, no shared
prefix between requests, EOS banned and stallfree-only fields dropped."""

from __future__ import annotations

import pytest

from stallfree.bench.loadgen import request_body
from stallfree.bench.textprompts import TextPrompts


@pytest.fixture(scope="module")
def tp() -> TextPrompts:
    return TextPrompts.from_gguf()


@pytest.mark.parametrize("length", [1, 2, 17, 340, 1500])
def test_text_encodes_to_exactly_the_requested_tokens(tp, length):
    text = tp.text(7, length, seed=0)
    assert len(tp.tokenizer.encode(text, add_special_tokens=False)) == length


def test_prompts_are_seeded_and_differ_from_the_first_word(tp):
    assert tp.text(1, 50, seed=0) == tp.text(1, 50, seed=0)
    firsts = {tp.text(i, 50, seed=0).split(" ")[1] for i in range(20)}
    assert len(firsts) >= 15  # no common prefix for a server's prefix cache to reuse


def test_body_becomes_text_with_eos_banned(tp):
    ids_body = request_body("m", [5, 6, 7], max_tokens=9, logprobs=False)
    body = tp.body(ids_body, index=4, length=3)
    assert (
        isinstance(body["prompt"], str)
        and len(tp.tokenizer.encode(body["prompt"], add_special_tokens=False)) == 3
    )
    assert body["logit_bias"] == {str(tp.eos_id): -100}
    assert "ignore_eos" not in body and "min_tokens" not in body
    assert body["max_tokens"] == 9 and body["stream"] is True


def test_each_salt_is_a_new_set_of_prompts(tp):
    """A capacity search gives every run its own salt, so a peer's prompt cache (which we cannot empty)
    never holds a prompt from an earlier run; salt 0 keeps the prompts recorded before salts existed."""
    from dataclasses import replace

    runs = [replace(tp, salt=s) for s in range(4)]
    texts = [[r.text(i, 40, seed=0) for i in range(8)] for r in runs]
    assert texts[0] == [tp.text(i, 40, seed=0) for i in range(8)]
    firsts = [{t.split(" ")[1] for t in run} for run in texts]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not set(texts[a]) & set(texts[b])
            assert len(firsts[a] & firsts[b]) <= 2  # no run shares the prefixes of another
    assert all(len(tp.tokenizer.encode(t, add_special_tokens=False)) == 40 for run in texts for t in run)
