"""Grammars over the real tokenizer: masks allow exactly what can continue, stop only at the end."""

import pytest
import torch

from stallfree.engine.sampler import SampleRequest, mask_disallowed, mask_rows
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.structured import StructuredOutputsParams
from stallfree.engine.structured.compiler import GrammarCompiler


@pytest.fixture(scope="module")
def compiler(default_model):
    return GrammarCompiler(default_model.tokenizer, default_model.config.vocab_size)


def allowed_ids(compiler, matcher) -> set[int]:
    bm = compiler.xgr.allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return {t for t in range(compiler.vocab_size) if (int(bm[0, t // 32]) >> (t % 32)) & 1}


def test_choice_allows_only_its_strings_then_only_stop(compiler, default_model):
    tok = default_model.tokenizer
    m = compiler.xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=("yes", "no"))))
    first = allowed_ids(compiler, m)
    assert first and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in first)
    assert not first & tok.stop_token_ids, "stop is not allowed before the output is complete"
    for t in tok.encode("no", add_special_tokens=False):
        assert m.accept_token(t)
    assert allowed_ids(compiler, m) <= tok.stop_token_ids
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def test_special_tokens_never_enter_json_strings(compiler, default_model):
    tok = default_model.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    m = compiler.xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)))
    for t in tok.encode('{"name": "Bo', add_special_tokens=False):
        assert m.accept_token(t)
    inside = allowed_ids(compiler, m)
    assert len(inside) > 1000  # nearly any text may follow inside a string
    assert tok.token_to_id("<|im_start|>") not in inside
    assert not inside & tok.stop_token_ids


def test_the_cache_returns_the_same_compiled_grammar(compiler):
    p = StructuredOutputsParams(regex="[a-z]{3}")
    assert compiler.compile(p) is compiler.compile(StructuredOutputsParams(regex="[a-z]{3}"))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="("), "invalid regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "invalid grammar"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "invalid json"),
    ],
)
def test_bad_grammars_are_value_errors_without_log_noise(compiler, params, message):
    with pytest.raises(ValueError, match=message) as e:
        compiler.compile(params)
    assert "/project/" not in str(e.value)


class _Mask:
    def __init__(self, allowed: list[int], vocab: int):
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
        for t in allowed:
            words[t // 32] |= 1 << (t % 32)
        self.words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def bitmask(self) -> torch.Tensor:
        return self.words


def test_the_sampler_hook_masks_only_constrained_rows():
    vocab = 100
    logits = torch.randn(3, vocab)
    before = logits.clone()
    p = SamplingParams()
    reqs = [
        SampleRequest("a", p, 0),
        SampleRequest("b", p, 0, allowed_tokens=_Mask([5, 63, 99], vocab)),
        SampleRequest("c", p, 0),
    ]
    mask_disallowed(logits, reqs)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == [5, 63, 99]
    assert torch.equal(logits[1, finite], before[1, finite])


def test_the_device_path_masks_the_same_tokens():
    """mask_rows (what CUDA runs, unpacking on the device) against the CPU path, on CPU tensors."""
    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    masks = [_Mask(torch.randperm(vocab, generator=gen)[:k].tolist(), vocab) for k in (1, 37, 999)]
    logits = torch.randn(5, vocab, generator=gen)
    p = SamplingParams()
    reqs = [
        SampleRequest(str(i), p, 0, allowed_tokens=masks[i // 2] if i % 2 == 0 else None) for i in range(5)
    ]
    cpu = mask_disallowed(logits.clone(), reqs)
    dev = mask_rows(logits.clone(), torch.tensor([0, 2, 4]), torch.stack([m.bitmask() for m in masks]))
    assert torch.equal(cpu, dev)
    assert [int(torch.isfinite(cpu[i]).sum()) for i in (0, 2, 4)] == [1, 37, 999]
