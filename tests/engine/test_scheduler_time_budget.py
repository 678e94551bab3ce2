"""Time-budgeted iterations (sarathi with a time target) under a fake cost model: pure, no torch.

The fake model prices an iteration at 10 ms + 1 ms per prefill token + 2 ms per decode, so a limit of L
seconds leaves (L - 0.010 - 0.002 d) / 0.001 prefill tokens with d decodes."""

from __future__ import annotations

import pytest
from factories import fake_step, make_request, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.costmodel.features import iteration_features
from stallfree.engine.config import SchedulerTunables, TrafficClusterLimits


class FakeCost:
    def __init__(self, base: float = 0.010, per_prefill: float = 0.001, per_decode: float = 0.002) -> None:
        self.base, self.per_prefill, self.per_decode = base, per_prefill, per_decode

    def predict(self, f) -> float:
        return self.base + self.per_prefill * f["prefill_tokens"] + self.per_decode * f["decode_tokens"]


STRICT = TrafficClusterLimits("chat", tbt_slo=0.1, ttft_slo=None)  # 0.8 x 0.1 = 80 ms an iteration
RELAXED = TrafficClusterLimits("docs", tbt_slo=1.0, ttft_slo=None)  # 800 ms


def timed(**kw):
    kw.setdefault("token_budget", 2048)
    kw.setdefault("time_target", 0.8)
    kw.setdefault("clusters", (STRICT, RELAXED))
    kw.setdefault("num_blocks", 1024)
    return make_scheduler(cost_model=FakeCost(), **kw)


def start_decoding(s, req) -> None:
    """Run `req` through its prefill so that it decodes from the next iteration."""
    s.add_request(req)
    while not s.get(req.request_id).output_token_ids:
        fake_step(s, s.schedule())


def test_no_decodes_means_the_cap_applies():
    s = timed(token_budget=1024)
    s.add_request(make_request(3000, cluster="docs"))
    out = s.schedule()
    assert out.time_limit is None
    assert out.num_prefill_tokens == 1024  # the whole cap: nobody is decoding


def test_the_chunk_shrinks_when_a_strict_request_decodes_and_grows_when_it_finishes():
    s = timed()
    chat = make_request(8, max_tokens=4, cluster="chat")
    start_decoding(s, chat)
    s.add_request(make_request(5000, max_tokens=1, cluster="docs", arrival=1.0))
    sizes, limits = [], []
    for _ in range(6):
        out = s.schedule()
        sizes.append(out.num_prefill_tokens)
        limits.append(out.time_limit)
        fake_step(s, out)
    # chat decodes in the first three iterations (its 2nd..4th tokens): 80 ms - 10 - 2 = 68 prefill tokens
    assert sizes[:3] == [68, 68, 68] and limits[:3] == [pytest.approx(0.08)] * 3
    assert s.get(chat.request_id) is None  # finished
    # then only the document prefills, and nobody decodes: the cap
    assert sizes[3:] == [2048, 2048, 5000 - 3 * 68 - 2 * 2048]
    assert limits[3] is None


def test_only_relaxed_decodes_allow_the_relaxed_clusters_time():
    s = timed()
    start_decoding(s, make_request(8, max_tokens=10, cluster="docs"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.time_limit == pytest.approx(0.8)
    assert out.num_prefill_tokens == 800 - 10 - 2  # (0.8 - 0.010 - 0.002) / 0.001


def test_the_strictest_decoding_cluster_sets_the_limit():
    s = timed()
    start_decoding(s, make_request(8, max_tokens=10, cluster="docs"))
    start_decoding(s, make_request(8, max_tokens=10, cluster="chat"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.num_decode_tokens == 2
    assert out.time_limit == pytest.approx(0.08)
    assert out.num_prefill_tokens == 80 - 10 - 4


def test_a_cluster_without_a_tbt_slo_gets_the_default_target():
    s = timed(clusters=())  # the default cluster has no SLO: SchedulerConfig.default_tbt_slo (0.25 s)
    start_decoding(s, make_request(8, max_tokens=10))
    s.add_request(make_request(4000, max_tokens=1, arrival=1.0))
    out = s.schedule()
    assert out.time_limit == pytest.approx(0.8 * 0.25)
    assert out.num_prefill_tokens == 200 - 10 - 2


def test_a_waiting_requests_ttft_slo_bounds_the_iteration():
    waiter = TrafficClusterLimits("chat", tbt_slo=0.1, ttft_slo=0.4)  # 0.25 x 0.4 = 100 ms
    s = timed(clusters=(waiter, RELAXED), max_num_seqs=1)  # the chat request has to wait for a slot
    s.add_request(make_request(4000, max_tokens=1, cluster="docs"))
    s.add_request(make_request(8, max_tokens=1, cluster="chat", arrival=1.0))
    out = s.schedule()
    assert out.time_limit == pytest.approx(0.1)
    assert out.num_prefill_tokens == 90


def test_the_floor_holds_when_the_decodes_alone_overrun():
    s = timed(min_token_budget=40, max_num_seqs=64)
    for _ in range(40):  # 40 chat decodes: 10 + 80 ms > 80 ms before any prefill
        start_decoding(s, make_request(8, max_tokens=200, cluster="chat"))
    s.add_request(make_request(1000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.num_decode_tokens == 40
    assert out.num_prefill_tokens == 0  # the floor (40 tokens) is taken by the decodes themselves
    s.tunables = SchedulerTunables(2048, (STRICT, RELAXED), time_target=0.8, min_token_budget=64)
    fake_step(s, out)
    out = s.schedule()
    assert out.num_decode_tokens == 40 and out.num_prefill_tokens == 24  # the floor's remainder


def test_the_cap_bounds_a_time_that_would_allow_more():
    s = timed(token_budget=300)
    start_decoding(s, make_request(8, max_tokens=10, cluster="docs"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.num_tokens == 300  # 800 ms would allow 788 prefill tokens


def test_chunks_stay_tile_aligned():
    s = timed(chunk_align=32)
    start_decoding(s, make_request(8, max_tokens=10, cluster="chat"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.num_prefill_tokens == 64  # 68 fits the time, rounded down to the tile


def test_the_token_mode_ignores_the_cost_model():
    s = timed(time_target=None, token_budget=100)
    start_decoding(s, make_request(8, max_tokens=10, cluster="chat"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.time_limit is None and out.predicted_time is None
    assert out.num_tokens == 100


def test_the_prediction_it_reports_is_the_models_for_the_batch():
    s = timed()
    start_decoding(s, make_request(8, max_tokens=10, cluster="chat"))
    s.add_request(make_request(4000, max_tokens=1, cluster="docs", arrival=1.0))
    out = s.schedule()
    assert out.predicted_time == pytest.approx(FakeCost().predict(iteration_features(out.chunks)))
    assert out.predicted_time <= out.time_limit


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    chats=st.integers(0, 6),
    cap=st.sampled_from([64, 256, 2048]),
    floor=st.sampled_from([1, 16, 48]),
    align=st.sampled_from([0, 16]),
)
def test_every_iteration_fits_its_time_or_stays_at_the_floor(prompts, chats, cap, floor, align):
    s = timed(token_budget=cap, min_token_budget=min(floor, cap), chunk_align=align, max_num_seqs=32)
    for _ in range(chats):
        start_decoding(s, make_request(4, max_tokens=30, cluster="chat"))
    for i, n in enumerate(prompts):
        s.add_request(make_request(n, max_tokens=3, cluster="docs", arrival=10.0 + i))
    model = FakeCost()
    for _ in range(500):
        if not s.has_unfinished():
            break
        out = s.schedule()
        assert out.num_tokens <= cap
        decodes_only = model.predict(iteration_features([c for c in out.chunks if c.is_decode]))
        if out.time_limit is not None and out.num_prefill_tokens:
            # prefill beyond the floor only where the whole iteration fits the time
            assert out.predicted_time <= out.time_limit + 1e-12 or out.num_tokens <= min(floor, cap)
            assert decodes_only <= out.predicted_time
        fake_step(s, out)
    assert not s.has_unfinished()  # and everything finished: the floor keeps prefill moving
