"""The piecewise CUDA-graph path's data flow, on CPU: graphs replaced by re-running their segment.

CUDA graphs need a GPU, so here (and only here) each captured segment is stood in for by a replay that calls
the same segment function again; what is checked is everything around the graphs: the persistent buffers,
padding rows (no K/V written, outputs ignored), the residual stream carried between segments and the
attention run eagerly in between. The GPU run of tests/engine/cuda/test_cuda_path.py checks the real graphs.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from cuda_helpers import TINY, _compare, _prompts, _run

from stallfree.engine import LLM
from stallfree.engine.cuda_graphs import PiecewiseGraphs
from stallfree.engine.model.dummy import build_dummy_model, synthetic_tokenizer
from stallfree.engine.model.loader import LoadedModel

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU stand-in only"
)


class _Replay:
    """Stands in for a captured torch.cuda.CUDAGraph: replay() runs the segment again."""

    def __init__(self, fn) -> None:
        self.replay = fn


def _fake_capture(self: PiecewiseGraphs, pool) -> None:
    for size in self.sizes:
        self.graphs[size] = [_Replay(partial(self._segment, s, size)) for s in range(self.num_layers + 1)]


def test_piecewise_flow_gives_the_eager_outputs(monkeypatch):
    loaded = LoadedModel(
        build_dummy_model(TINY, torch.float32, "cpu"), synthetic_tokenizer(512), TINY, "tiny"
    )
    prompts = _prompts(TINY.vocab_size, [70, 7, 33, 18])

    def llm(piecewise: bool) -> LLM:
        out = LLM(loaded_model=loaded, attention_backend="triton", token_budget=24, device="cpu",
                  dtype="float32", num_kv_blocks=64, max_num_seqs=8)  # fmt: skip
        if piecewise:
            runner = out.engine.executor.runner
            runner.piecewise = PiecewiseGraphs(runner.model, runner.backend, [16, 32])
            monkeypatch.setattr(PiecewiseGraphs, "capture", _fake_capture)
            runner.piecewise.capture(None)
        return out

    eager = _run(llm(False), prompts, 8)
    calls = []
    orig_run = PiecewiseGraphs.run
    monkeypatch.setattr(
        PiecewiseGraphs, "run", lambda self, *a: calls.append(a[0].num_tokens) or orig_run(self, *a)
    )
    pieces = _run(llm(True), prompts, 8)
    assert calls and max(calls) <= 32 and any(n not in (16, 32) for n in calls), "padding was not exercised"
    _compare(eager, pieces, torch.float32, "piecewise (stand-in) vs eager")
    assert [o.token_ids for o in pieces] == [o.token_ids for o in eager]
