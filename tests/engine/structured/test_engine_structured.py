"""Constrained generation in the engine: outputs match their constraint, end where the grammar ends, and
share hybrid batches without changing what unconstrained neighbours generate."""

import json
import re

import jsonschema
import pytest
from engine_helpers import greedy, make_llm, prompt_ids

from stallfree.engine import SamplingParams
from stallfree.engine.structured import StructuredOutputsParams

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {
            "type": "array",
            "items": {"type": "string", "enum": ["tea", "cats", "rain"]},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(default_model):
    # a small budget: prompts are chunked and constrained rows ride in hybrid batches with prefills
    return make_llm(default_model, token_budget=48)


def test_outputs_obey_their_constraints(llm):
    cases = [
        (StructuredOutputsParams(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} is [0-9]{1,2}"),
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2}", t) or 1 / 0),
        (StructuredOutputsParams(choice=("red", "green", "blue")), lambda t: t in ("red", "green", "blue") or 1 / 0),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
         lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t) or 1 / 0),
    ]  # fmt: skip
    prompts = [CHAT.format("Describe a person as JSON.")] * len(cases)
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so) for so, _ in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (so, check), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop", (so.kind, out.text)
        check(out.text)


def test_sampled_outputs_obey_the_schema_too(llm):
    prompts = [CHAT.format(f"Invent person number {i} as JSON.") for i in range(6)]
    params = [
        SamplingParams(
            max_tokens=80, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        )
        for i in range(6)
    ]
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_unconstrained_neighbours_generate_exactly_what_they_do_alone(llm, default_model):
    tok = default_model.tokenizer
    plain = [prompt_ids(tok, n) for n in (20, 75, 130)]
    alone = [o.token_ids for o in llm.generate(plain, greedy(24, ignore_eos=True), use_tqdm=False)]
    constrained = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    mixed = llm.generate(
        [plain[0], CHAT.format("A person as JSON."), plain[1], CHAT.format("Another one."), plain[2]],
        [greedy(24, ignore_eos=True), constrained, greedy(24, ignore_eos=True), constrained, greedy(24, ignore_eos=True)],
        use_tqdm=False,
    )  # fmt: skip
    assert [mixed[i].token_ids for i in (0, 2, 4)] == alone


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    p = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
    )
    out = llm.generate([CHAT.format("Is water wet?")], p, use_tqdm=False)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 30


def test_a_bad_grammar_is_refused_when_the_request_is_added(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.engine.add_request(
            "bad", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="["))
        )
    assert not llm.engine.has_unfinished_requests()


def test_an_engine_over_worker_ranks_refuses_constraints_it_cannot_carry():
    """The grammar masks are filled by a thread of the leader: the parallel executor says it cannot carry
    them, and the engine refuses such a request (checked here without starting any worker)."""
    from types import SimpleNamespace

    from stallfree.engine.engine import LLMEngine
    from stallfree.engine.parallel.executor import ParallelExecutor

    engine = SimpleNamespace(executor=ParallelExecutor)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="not supported with tensor or pipeline parallelism"):
        LLMEngine.validate_prompt(engine, [1, 2], params)  # type: ignore[arg-type]
