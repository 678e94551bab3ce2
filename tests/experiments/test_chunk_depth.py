"""experiments.chunk_depth on the real bundled model, a short prompt: chunks shrink with depth when charged."""

from experiments.chunk_depth import prefill_iterations
from stallfree.engine.scheduler import fit_chunk


def test_charged_chunks_shrink_with_depth_and_fit_the_budget(default_model):
    plain = prefill_iterations(default_model, budget=26, scale=None, prompt=90, decodes=2, salt=0)
    charged = prefill_iterations(default_model, budget=26, scale=16, prompt=90, decodes=2, salt=0)
    assert [r["tokens"] for r in plain] == [24, 24, 24, 18]  # the budget less the two decodes
    assert sum(r["tokens"] for r in charged) == 90 and len(charged) > len(plain)
    for r in charged[:-1]:  # each chunk the largest whose charge fits what the decodes leave
        assert r["tokens"] == fit_chunk(24, r["start"], 16)
    assert charged[0]["tokens"] > charged[-2]["tokens"]
    assert all(r["ms"] > 0 for r in plain + charged)
