"""Trace loading, scaling, clipping, seeded sampling and Poisson arrivals."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from bench_factories import make_trace, write_trace

from stallfree.bench.traces import (
    TRACE_FILES,
    load_trace,
    make_workload,
    poisson_arrivals,
    prompt_token_ids,
    resolve_trace,
    scale_and_clip,
    traces_dir,
)


def test_scale_rounds_and_keeps_at_least_one_token():
    p, o, clipped = scale_and_clip(np.array([800, 3, 100]), np.array([80, 2, 9]), 0.125, 8192)
    assert p.tolist() == [100, 1, 12]
    assert o.tolist() == [10, 1, 1]
    assert clipped == 0


def test_clip_keeps_prompt_then_cuts_output_to_the_context():
    p, o, clipped = scale_and_clip(np.array([100, 300, 20]), np.array([50, 10, 5]), 1.0, 128)
    assert p.tolist() == [100, 127, 20]
    assert o.tolist() == [28, 1, 5]
    assert (p + o <= 128).all()
    assert clipped == 2


def test_scale_must_be_positive():
    with pytest.raises(ValueError, match="scale"):
        scale_and_clip(np.array([1]), np.array([1]), 0.0, 100)


def test_workload_is_seeded_and_qps_only_compresses_arrivals(tmp_path):
    trace = make_trace(tmp_path)
    a = make_workload(trace, 50, qps=1.0, seed=3)
    b = make_workload(trace, 50, qps=1.0, seed=3)
    c = make_workload(trace, 50, qps=4.0, seed=3)
    d = make_workload(trace, 50, qps=1.0, seed=4)
    assert a.requests == b.requests
    assert [r.prompt_tokens for r in a.requests] == [r.prompt_tokens for r in c.requests]
    assert np.allclose([r.arrival / 4 for r in a.requests], [r.arrival for r in c.requests])
    assert [r.prompt_tokens for r in a.requests] != [r.prompt_tokens for r in d.requests]


def test_poisson_arrivals_have_the_requested_rate():
    t = poisson_arrivals(20_000, 5.0, seed=0)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    assert len(t) / t[-1] == pytest.approx(5.0, rel=0.05)


def test_trace_arrival_times_are_used_without_qps(tmp_path):
    trace = load_trace(str(write_trace(tmp_path / "t.csv", [(10, 2)] * 4, arrivals=[5.0, 5.5, 7.0, 9.0])))
    wl = make_workload(trace, 4, qps=None)
    assert [r.arrival for r in wl.requests] == [0.0, 0.5, 2.0, 4.0]
    no_times = make_trace(tmp_path)
    with pytest.raises(ValueError, match="no arrival times"):
        make_workload(no_times, 4, qps=None)


def test_describe_reports_scale_and_clipping(tmp_path):
    trace = make_trace(tmp_path, prompt=400)
    wl = make_workload(trace, 100, qps=1.0, scale=1.0, max_model_len=300)
    d = wl.describe()
    assert d["num_clipped"] > 0 and d["prompt_tokens_max"] <= 299 and d["max_model_len"] == 300


def test_missing_columns_and_paths_are_explained(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        load_trace(str(bad))
    with pytest.raises(ValueError, match="STALLFREE_TRACES"):
        resolve_trace(str(tmp_path / "nope.csv"))


def test_env_override_locates_named_traces(tmp_path, monkeypatch):
    write_trace(tmp_path / TRACE_FILES["arxiv"], [(3000, 100)])
    monkeypatch.setenv("STALLFREE_TRACES", str(tmp_path))
    assert traces_dir() == tmp_path
    assert load_trace("arxiv").prompt_tokens.tolist() == [3000]


def test_named_traces_ship_with_the_repository(monkeypatch):
    # A clone with nothing beside it finds them: the default folder is the repository's data/traces/.
    monkeypatch.delenv("STALLFREE_TRACES", raising=False)
    assert traces_dir() == Path(__file__).resolve().parents[2] / "data" / "traces"
    arxiv, sharegpt = load_trace("arxiv"), load_trace("sharegpt")
    assert len(arxiv) == 28257 and len(sharegpt) == 30731
    assert np.median(arxiv.prompt_tokens) == pytest.approx(2730, rel=0.01)


def test_shipped_traces_are_the_recorded_bytes():
    # SOURCES.md names each file's sha256: byte-for-byte what its source repository holds.
    folder = Path(__file__).resolve().parents[2] / "data" / "traces"
    sources = (folder / "SOURCES.md").read_text()
    for name in TRACE_FILES.values():
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert f"{name} {digest}" in sources


def test_a_wheel_carries_the_traces_as_package_data():
    # Without a checkout, traces_dir() falls back to stallfree/traces/ beside the installed package.
    # (tests/test_packaging.py installs a built wheel and finds them there; this checks setup.py's map.)
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("stallfree_setup", repo / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    assert setup.DATA_PACKAGES["stallfree.traces"] == "data/traces"
    assert "stallfree.traces" in setup.discover()
    assert "*.csv" in setup.PACKAGE_DATA["stallfree.traces"]


def test_prompt_ids_are_deterministic_and_distinct():
    a = prompt_token_ids(1, 50)
    assert a == prompt_token_ids(1, 50) and len(a) == 50
    assert a != prompt_token_ids(2, 50)
    assert all(1000 <= t < 30000 for t in a)


def test_max_output_tokens_caps_outputs_only(tmp_path):
    trace = make_trace(tmp_path, n=50, output=60)  # outputs 30..89
    capped = make_workload(trace, 20, qps=1.0, seed=0, max_output_tokens=32)
    full = make_workload(trace, 20, qps=1.0, seed=0)
    assert [r.output_tokens for r in capped.requests] == [min(32, r.output_tokens) for r in full.requests]
    assert [r.prompt_tokens for r in capped.requests] == [r.prompt_tokens for r in full.requests]
    assert max(r.output_tokens for r in full.requests) > 32
