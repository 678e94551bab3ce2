"""What LLMEngine.step does when something under it raises: a failed forward pass fails the requests of its
batch and the engine runs on; a scheduler bug is not a forward failure and propagates (the server's engine
loop then stops and turns unready: tests/engine/server/test_admission_and_faults.py)."""

from __future__ import annotations

import pytest

from stallfree.engine import LLM, SamplingParams


def test_a_failed_forward_fails_its_batch_and_the_engine_runs_on(default_model, monkeypatch):
    llm = LLM(loaded_model=default_model, token_budget=64)
    engine = llm.engine
    real, calls = engine.executor.submit, []

    def submit_once_broken(sched):
        calls.append(sched)
        if len(calls) == 1:
            raise RuntimeError("kernel fault")
        return real(sched)

    monkeypatch.setattr(engine.executor, "submit", submit_once_broken)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("a", engine.tokenize("The capital of France is"), sp)
    outs = engine.step()
    assert [(o.request_id, o.finished) for o in outs] == [("a", True)]
    assert outs[0].finish_reason == "error" and "kernel fault" in (outs[0].error or "")
    assert not engine.has_unfinished_requests() and engine.dead is None
    # The next request runs to its end on the same engine.
    (again,) = llm.generate("The capital of France is", sp, use_tqdm=False)
    assert again.finish_reason == "length" and len(again.token_ids) == 4


def test_a_scheduler_bug_propagates_instead_of_failing_nothing_forever(default_model, monkeypatch):
    engine = LLM(loaded_model=default_model).engine

    def broken():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    engine.add_request("a", engine.tokenize("Hi"), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="scheduler bug"):
        engine.step()
