"""CUDA graphs of pipeline stages (the parallel workers' runners), on CPU: graphs replaced by re-running what
they captured.

CUDA graphs need a GPU, so here (and only here) a captured graph is stood in for by a replay that runs the
same function again into the same output buffer (as tests/engine/cuda/test_piecewise_flow.py does for the
single-device runner). What is checked is what a stage adds around the graphs: a later stage's graphs read
the previous stage's hidden states from their input buffer instead of embedding ids; a stage before the
last ends with the residual stream it hands on (not the norm and logits) and sends a copy of the graph's
output buffer; decode-only iterations replay a stage's decode graph, hybrid ones its piecewise graphs. Two
stages in one process, linked by a queue, against the whole model run eagerly: the same logits.
"""

from __future__ import annotations

import os
from collections import deque
from functools import partial

import pytest
import torch
from cuda_helpers import TINY

from stallfree.engine.attention import KVCache, make_backend
from stallfree.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from stallfree.engine.model.dummy import build_dummy_model
from stallfree.engine.model_runner import ModelRunner
from stallfree.engine.parallel.stage import build_stage
from stallfree.engine.sampling_params import SamplingParams
from stallfree.engine.scheduler import ScheduledChunk, SchedulerOutput

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU stand-in only"
)
BLOCK = 16
BACKEND = "triton"  # supports graphs; runs through Triton's interpreter here


class _Replay:
    """Stands in for a captured torch.cuda.CUDAGraph: replay() runs the captured function again."""

    def __init__(self, fn) -> None:
        self.replay = fn


def _fake_piecewise_capture(self: PiecewiseGraphs, pool) -> None:
    for size in self.sizes:
        self.graphs[size] = [_Replay(partial(self._segment, s, size)) for s in range(self.num_layers + 1)]


def _fake_decode_capture(self: DecodeGraphs, pool) -> None:
    for size in self.sizes:
        out = self._forward(size)  # the graph's output buffer

        def replay(size=size, out=out) -> None:
            out.copy_(self._forward(size))

        self.graphs[size] = (_Replay(replay), out)


class QueueLink:
    """A StageLink between two stages in one process."""

    def __init__(self, last: bool, inbox: deque | None, outbox: deque | None) -> None:
        self.last, self.inbox, self.outbox = last, inbox, outbox
        self.sent: list[torch.Tensor] = []

    def receive(self, num_tokens: int) -> torch.Tensor | None:
        if self.inbox is None:
            return None
        x = self.inbox.popleft()
        assert x.shape[0] == num_tokens
        return x

    def send(self, hidden: torch.Tensor) -> None:
        self.sent.append(hidden)
        self.outbox.append(hidden)


def _chunk(rid: str, ids: list[int], start: int, table: tuple[int, ...], decode: bool, sample: bool):
    return ScheduledChunk(rid, tuple(ids), start, table, decode, sample, "c", SamplingParams(max_tokens=8), 0)


def _iterations() -> list[SchedulerOutput]:
    """Three requests through hybrid iterations (piecewise graphs) and decode-only ones (decode graphs, the
    second padded from 3 rows to 4)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist() for n in (40, 7, 20))
    A, B, C = (0, 1, 2), (3,), (4, 5)
    steps = [
        [_chunk("b", b, 0, B, False, True), _chunk("a", a[:20], 0, A, False, False)],
        [_chunk("b", [11], 7, B, True, True), _chunk("a", a[20:], 20, A, False, True)],
        [_chunk("a", [12], 40, A, True, True), _chunk("b", [13], 8, B, True, True)],
        [_chunk("a", [14], 41, A, True, True), _chunk("b", [15], 9, B, True, True), _chunk("c", c, 0, C, False, True)],
        [_chunk("a", [16], 42, A, True, True), _chunk("b", [17], 10, B, True, True), _chunk("c", [18], 20, C, True, True)],
    ]  # fmt: skip
    out = []
    for chunks in steps:
        decodes = sum(ch.is_decode for ch in chunks)
        tokens = sum(ch.num_tokens for ch in chunks)
        out.append(SchedulerOutput(tuple(chunks), (), 64, tokens - decodes, decodes))
    return out


def _runner(model, layers: int, link=None, graphs: bool = False, heads: tuple[int, int] | None = None):
    nh, nkv = heads or (TINY.num_heads, TINY.num_kv_heads)
    cache = KVCache(layers, 8, BLOCK, nkv, TINY.head_dim, torch.float32, "cpu")
    backend = make_backend(BACKEND, cache, nh, nkv, TINY.head_dim)
    runner = ModelRunner(model, backend, stop_token_ids=frozenset(), link=link)
    if graphs:  # what ModelRunner builds on a CUDA device, with the captures stood in for
        runner.graphs = DecodeGraphs(model, backend, [1, 2, 4], max_pages=4)
        _fake_decode_capture(runner.graphs, None)
        runner.piecewise = PiecewiseGraphs(model, backend, [16, 32])
        _fake_piecewise_capture(runner.piecewise, None)
    return runner


def _logits_of(runner: ModelRunner) -> list[torch.Tensor]:
    """Every logits tensor the runner hands its sampler, in order."""
    seen: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda logits, reqs: seen.append(logits.clone()) or sample(logits, reqs)
    return seen


def test_two_stages_replaying_graphs_give_the_whole_models_logits(monkeypatch):
    full = build_dummy_model(TINY, torch.float32, "cpu")
    state = full.state_dict()
    stages = [build_stage(TINY, state, tp_size=1, tp_rank=0, pp_size=2, stage=s) for s in (0, 1)]
    assert not stages[0].last_stage and not stages[1].first_stage

    ref = _runner(full, TINY.num_layers)
    ref_logits = _logits_of(ref)
    pipe = deque()
    first = _runner(stages[0], stages[0].num_layers, QueueLink(False, None, pipe), graphs=True)
    last = _runner(stages[1], stages[1].num_layers, QueueLink(True, pipe, None), graphs=True)
    got_logits = _logits_of(last)
    paths: list[str] = []
    for cls, name in ((DecodeGraphs, "decode"), (PiecewiseGraphs, "piecewise")):
        run = cls.run
        monkeypatch.setattr(
            cls, "run", lambda self, *a, run=run, name=name: paths.append(name) or run(self, *a)
        )

    for out in _iterations():
        ref.execute(out)
        first.execute(out)
        last.execute(out)
    assert not pipe, "every hand-off was received"
    # Each iteration ran the same graph kind on both stages: hybrid ones piecewise, decode-only ones whole.
    assert paths == [p for p in ["piecewise", "piecewise", "decode", "piecewise", "decode"] for _ in (0, 1)]
    buffers = {first.piecewise.hidden.data_ptr()} | {
        out.data_ptr() for _, out in first.graphs.graphs.values()
    }
    assert len(first.link.sent) == 5 and not any(h.data_ptr() in buffers for h in first.link.sent), (
        "a stage must send a copy of a graph's output buffer, which the next replay rewrites"
    )
    assert len(got_logits) == len(ref_logits) == 5
    for i, (r, g) in enumerate(zip(ref_logits, got_logits, strict=True)):
        assert r.shape == g.shape, f"iteration {i}"
        torch.testing.assert_close(g, r, atol=2e-4, rtol=1e-4, msg=f"iteration {i}: pipeline stages vs whole")


def test_a_tensor_parallel_shard_sizes_its_graph_buffers_by_its_own_heads():
    """A rank's graphs hold its share of the heads (the stage's config still names the whole model's): a
    rank-1-of-2 shard, its collectives stood in for by the identity, replays the same logits as it runs
    eagerly."""
    full = build_dummy_model(TINY, torch.float32, "cpu")
    shard = build_stage(TINY, full.state_dict(), tp_size=2, tp_rank=1, pp_size=1, stage=0)
    heads = (TINY.num_heads // 2, TINY.num_kv_heads // 2)
    eager = _runner(shard, TINY.num_layers, heads=heads)
    graphed = _runner(shard, TINY.num_layers, heads=heads, graphs=True)
    assert graphed.piecewise.qkv.shape[1] == (heads[0] + 2 * heads[1]) * TINY.head_dim
    want, got = _logits_of(eager), _logits_of(graphed)
    for out in _iterations():
        eager.execute(out)
        graphed.execute(out)
    assert len(got) == len(want) == 5
    for i, (r, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, r, atol=2e-4, rtol=1e-4, msg=f"iteration {i}: graphs vs eager")
