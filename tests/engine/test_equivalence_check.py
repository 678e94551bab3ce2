"""The refactor checker (tests/engine/equivalence_check.py) is deterministic and sharp: two runs of the same
tree record bit-identical logits and tokens, and a change in one logit or one token is reported."""

from __future__ import annotations

import equivalence_check as ec
import torch


def test_two_runs_agree_and_a_perturbation_is_caught() -> None:
    a = ec.run_all(["torch-tiny-fp32"])
    b = ec.run_all(["torch-tiny-fp32"])
    (key,) = a
    steps = a[key]
    assert len(steps) > 5 and sum(len(t) for _, t in steps) > 0, "the scenario must sample tokens"
    assert any(lg.shape[0] > 1 for lg, _ in steps), "some iteration must sample several rows"
    assert ec.compare(a, b) == []

    i = next(i for i, (lg, _) in enumerate(steps) if lg.numel())
    logits, toks = steps[i]
    nudged = logits.clone()
    nudged.view(-1)[0] = torch.nextafter(nudged.view(-1)[0], torch.tensor(float("inf")))  # one ulp
    problems = ec.compare({key: [*steps[:i], (nudged, toks), *steps[i + 1 :]]}, b)
    assert len(problems) == 1 and "logits differ" in problems[0]

    j = next(j for j, (_, t) in enumerate(steps) if t)
    lg, t = steps[j]
    flipped = [(t[0][0], [*t[0][1][:-1], t[0][1][-1] + 1]), *t[1:]]
    problems = ec.compare({key: [*steps[:j], (lg, flipped), *steps[j + 1 :]]}, b)
    assert len(problems) == 1 and "tokens" in problems[0]
